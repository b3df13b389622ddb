"""Maps the card's top-level folders into one import namespace, ``conflux_cluster``.

``engine/`` installs as ``conflux_cluster.engine``, ``actors/`` as ``conflux_cluster.actors`` and
``router/`` as ``conflux_cluster.router`` (``dashboards/`` as ``conflux_cluster.dashboards``, for its
JSON): no generic top-level module (``engine``, ``router``)
reaches site-packages. Works for wheels and for editable installs (setuptools' editable finder
honours ``package_dir``), so pytest, Ray workers and the CLI all import the same names.
"""

from setuptools import find_packages, setup

NAMESPACE = {
    "conflux_cluster": "conflux_cluster",
    "conflux_cluster.engine": "engine",
    "conflux_cluster.actors": "actors",
    "conflux_cluster.router": "router",
    "conflux_cluster.dashboards": "dashboards",  # the Grafana JSON, for `conflux dashboards push`
}

packages = []
for package, folder in NAMESPACE.items():
    packages.append(package)
    packages.extend(f"{package}.{sub}" for sub in find_packages(folder))

setup(packages=packages, package_dir=NAMESPACE,
      package_data={"conflux_cluster.data": ["traces/*"], "conflux_cluster.dashboards": ["*.json"]})
