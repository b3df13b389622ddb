"""The profiler: fitting pipeline on synthetic measurements, and a real (tiny) engine run on CPU."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from conflux_cluster.engine.profiling.harness import ProfileGrid
from conflux_cluster.engine.scheduler.fitting.samples import Measurements, fit_measurements
from conflux_cluster.engine.scheduler.estimator import Affine, BatchLoad, EstimatorProfile, LatencyEstimator
from conflux_cluster.engine.scheduler.fitting.fit import BatchSample, fit_linear2

TRUE = EstimatorProfile(model="m", hardware="synthetic", num_ranks=2, num_layers=32,
                        f_gemm=Affine(1.5e-7, 4e-4), f_prefill_attn=Affine(3e-11, 8e-5),
                        f_decode_attn=Affine(2e-9, 1e-4), f_comm=Affine(5e-8, 9e-5), alpha=1.3, beta=1.15,
                        f_prefill_kv=Affine(4e-8, 0.0))


def _families(rng, est, n=2):
    def sample(load):
        return BatchSample(load, est.estimate(load).total * rng.uniform(0.995, 1.005))

    def decodes():
        d = [rng.randint(1, 64) for _ in range(n)]
        return tuple(d), tuple(k * rng.choice([1024, 2048, 4096, 8192]) for k in d)

    def prefill(k):
        chunks = tuple((rng.choice([32, 256, 1024, 4096, 8192]), rng.choice([0, 2048, 4096, 16384])) for _ in range(k))
        tot = sum(l for l, _ in chunks)
        return tuple(tot // n + (r < tot % n) for r in range(n)), chunks

    m = Measurements()
    for _ in range(30):
        d, c = decodes()
        m.decode.append(sample(BatchLoad((0,) * n, d, c)))
        p, ch = prefill(1)
        m.prefill.append(sample(BatchLoad(p, (0,) * n, (0,) * n, ch)))
    for _ in range(120):
        d, c = decodes()
        p, ch = prefill(rng.randint(1, 2))
        m.hetero.append(sample(BatchLoad(p, d, c, ch)))
    return m


def test_fit_measurements_recovers_a_known_engine(tmp_path):
    rng = random.Random(0)
    m = _families(rng, LatencyEstimator(TRUE))
    m.to_json(tmp_path / "raw.json")
    m2 = Measurements.from_json(tmp_path / "raw.json")
    assert m2.hetero[5].load == m.hetero[5].load and m2.decode[0].seconds == m.decode[0].seconds
    p = fit_measurements(m2, model="m", hardware="synthetic", num_ranks=2, num_layers=32)
    assert p.meta["mape_percent_hetero_heldout"] < 2.0
    # Eq. 4 applies α, β to T_D, T_P in every step, so only the products are identifiable
    assert p.alpha * p.f_decode_attn.slope == pytest.approx(1.3 * 2e-9, rel=0.1)
    assert p.beta * p.f_prefill_kv.slope == pytest.approx(1.15 * 4e-8, rel=0.15)
    assert p.f_gemm.slope == pytest.approx(1.5e-7, rel=0.05)
    # a wrong model (no contention, no KV term) is measurably worse on the same held-out data
    worse = replace(p, alpha=1.0, beta=1.0, f_prefill_kv=Affine(0.0, 0.0))
    from conflux_cluster.engine.scheduler.fitting.fit import profile_mape
    assert profile_mape(worse, m.hetero[1::2]) > 2 * p.meta["mape_percent_hetero_heldout"]


def test_fit_measurements_recovers_the_cobatch_overhead():
    """κ: what only mixed steps pay (measured on one H200: ~0.5 ms per layer); without it the
    mixed steps' held-out error is several times larger."""
    rng = random.Random(4)
    true = replace(TRUE, cobatch=5e-4)
    m = _families(rng, LatencyEstimator(true))
    p = fit_measurements(m, model="m", hardware="synthetic", num_ranks=2, num_layers=32)
    assert p.cobatch == pytest.approx(5e-4, rel=0.15)
    assert p.meta["mape_percent_hetero_heldout"] < 2.0
    from conflux_cluster.engine.scheduler.fitting.fit import profile_mape
    assert profile_mape(replace(p, cobatch=0.0), m.hetero[1::2]) > 3 * p.meta["mape_percent_hetero_heldout"]
    plain = fit_measurements(_families(random.Random(4), LatencyEstimator(TRUE)), model="m", hardware="synthetic",
                             num_ranks=2, num_layers=32)
    assert plain.cobatch < 5e-5  # an engine without the overhead gets (about) none


def test_fit_with_query_tiles_recovers_a_tiled_engine():
    """An engine whose chunks attend their history in 128-query tiles (flash on CUDA): the fit that
    counts whole tiles recovers it; the untiled one misprices odd chunks over long histories."""
    rng = random.Random(5)
    true = replace(TRUE, num_ranks=1, f_comm=Affine(0.0, 0.0), query_tile=128)
    est = LatencyEstimator(true)

    def sample(load: BatchLoad) -> BatchSample:
        return BatchSample(load, est.estimate(load).total * rng.uniform(0.995, 1.005))

    def chunk_step(decodes: int) -> BatchSample:
        ell, c = rng.randint(16, 1200), rng.choice([0, 4096, 32768, 98304])
        d = rng.randint(1, 32) * decodes
        return sample(BatchLoad((ell,), (d,), (d * 4096,), ((ell, c),)))

    m = Measurements()
    for d in (rng.randint(1, 64) for _ in range(30)):
        m.decode.append(sample(BatchLoad((0,), (d,), (d * 2048,))))
        m.prefill.append(chunk_step(0))
    m.hetero = [chunk_step(1) for _ in range(120)]
    tiled = fit_measurements(m, model="m", hardware="synthetic", num_ranks=1, num_layers=32, query_tile=128)
    plain = fit_measurements(m, model="m", hardware="synthetic", num_ranks=1, num_layers=32)
    assert tiled.query_tile == 128 and plain.query_tile == 1
    assert tiled.meta["mape_percent_hetero_heldout"] < 2.0
    assert plain.meta["mape_percent_hetero_heldout"] > 2 * tiled.meta["mape_percent_hetero_heldout"]


def test_fit_linear2_separates_two_workloads():
    rng = random.Random(1)
    x1 = [rng.uniform(1, 100) for _ in range(50)]
    x2 = [rng.uniform(1e3, 1e6) for _ in range(50)]
    y = [2e-6 * a + 3e-9 * b + 1e-4 for a, b in zip(x1, x2)]
    b1, b2, c = fit_linear2(x1, x2, y)
    assert (b1, b2, c) == (pytest.approx(2e-6, rel=1e-6), pytest.approx(3e-9, rel=1e-6), pytest.approx(1e-4, rel=1e-6))
    b1, b2, c = fit_linear2(x1, x2, [1e-4 - 1e-7 * a for a in x1])  # negative slope is dropped
    assert b1 == 0.0 and c > 0


def test_profile_tiny_engine_on_cpu(tmp_path):
    """The real engine (tiny-llama, one rank, in-process) end to end: samples make sense, JSON loads."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from conflux_cluster.engine.config import EngineConfig
    from conflux_cluster.engine.profiling.harness import profile_engine

    grid = ProfileGrid(decode_batch=[1, 4], decode_context=[16, 48], prefill_chunk=[16, 64, 128],
                       prefill_context=[0, 32], hetero_batches=12, repeats=2, hetero_repeats=1, warmup=1,
                       setup_tokens_per_step=64, time_budget_s=60)
    cfg = EngineConfig(model="tiny-llama", num_kv_blocks=512, num_threads=1, load_progress=False)
    raw = tmp_path / "raw.json"
    prof = profile_engine(cfg, grid, "cpu-test", raw_out=str(raw), log=lambda *a: None)
    m = Measurements.from_json(raw)
    assert len(m.decode) == 4 and len(m.prefill) == 6 and len(m.hetero) == 12  # a prefill point: its fastest run
    assert all(s.seconds > 0 for s in m.decode + m.prefill + m.hetero)
    assert [s.load.decode_tokens for s in m.decode] == [(1,), (1,), (4,), (4,)]
    assert [sum(s.load.prefill_tokens) for s in m.prefill] == [16] * 2 + [64] * 2 + [128] * 2
    assert [c for s in m.prefill for _, c in s.load.prefill_chunks] == [0, 32] * 3
    assert all(any(s.load.decode_tokens) and any(s.load.prefill_tokens) for s in m.hetero)
    assert 1.0 <= prof.alpha <= 4.0 and 1.0 <= prof.beta <= 4.0 and prof.num_layers == 2
    from conflux_cluster.engine.profiling.store import ENGINE_REVISION
    assert prof.query_tile == 1 and prof.meta["engine_revision"] == ENGINE_REVISION  # CPU: no flash tiles
    prof.to_json(tmp_path / "p.json")
    assert EstimatorProfile.from_json(tmp_path / "p.json") == prof


def test_timed_steps_carry_no_registration_or_frees():
    """A chunk at context 0 has no setup step: its timed step must still not carry the new request's
    registration or the previous sample's frees (host work no served step of that shape pays)."""
    from conflux_cluster.engine.contracts.step import StepResult
    from conflux_cluster.engine.profiling.harness import _Harness, _measure_chunks_once, engine_adapters

    class Recording:
        def __init__(self):
            self.inputs = []

        def execute(self, inp):
            self.inputs.append(inp)
            return StepResult(inp.plan.step, {})

    ex = Recording()
    h = _Harness(ex, 2, 1000, random.Random(0), *engine_adapters(), setup_tokens=64)
    for chunks in ([(8, 0)], [(8, 0), (16, 0)], [(8, 100)], [(8, 0)]):
        before = len(ex.inputs)
        sample = _measure_chunks_once(h, chunks, [[], []])
        timed = ex.inputs[-1]
        assert len(ex.inputs) > before + 1  # an untimed step ran first
        assert not timed.new_requests and not timed.plan.finished
        assert sum(s.num_tokens for s in timed.plan.prefill) == sum(l for l, _ in chunks) == sum(sample.load.prefill_tokens)


def test_profile_outputs_are_checked_before_measuring(tmp_path, capsys):
    """--out / --raw-out that cannot be written fail before anything is loaded or measured (the
    measurement takes minutes); so do non-finite numbers."""
    from conflux_cluster.cli import main

    base = ["profile", "--model", "tiny-llama", "--grid", "cpu"]
    for argv, flag in ((["--out", str(tmp_path / "missing" / "p.json")], "--out"),
                       (["--out", str(tmp_path)], "--out"),
                       (["--out", str(tmp_path / "p.json"), "--raw-out", str(tmp_path / "no" / "raw.json")], "--raw-out"),
                       (["--out", str(tmp_path / "p.json"), "--time-budget", "nan"], "--time-budget")):
        assert main([*base, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"conflux profile: error: {flag}") and "Traceback" not in err, err
    for argv, flag in ((["--query-tile", "0"], "--query-tile"), (["--prefill-chunks", "32,abc"], "--prefill-chunks"),
                       (["--prefill-contexts", "0,-1"], "--prefill-contexts")):
        try:  # argparse's own errors exit; ours return 2
            code = main([*base, "--out", str(tmp_path / "p.json"), *argv])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and flag in err and "Traceback" not in err, (argv, err)
    assert not list(tmp_path.iterdir())


def test_malformed_profile_and_samples_files_name_the_file(tmp_path, capsys):
    """EstimatorProfile.from_json / Measurements.load (and --fit-only, estimator_profile) on a binary file,
    broken JSON or missing fields: a ValueError naming the file and what is wrong."""
    from conflux_cluster.cli import main
    from conflux_cluster.engine.scheduler.config import SchedulerConfig
    from conflux_cluster.engine.scheduler.scheduler import load_estimator

    binary, cut = tmp_path / "b.json", tmp_path / "cut.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    cut.write_text('{"decode": [')
    no_field = tmp_path / "raw.json"
    no_field.write_text('{"decode": [{"seconds": 0.1, "prefill_tokens": [0], "decode_tokens": [1], '
                        '"decode_context": [5]}], "prefill": [], "hetero": []}')
    for path, what in ((binary, "not a text file"), (cut, r"invalid JSON \(line 1, column 13")):
        for load in (EstimatorProfile.from_json, Measurements.load):
            with pytest.raises(ValueError, match=f"{path}: {what}"):
                load(path)
        with pytest.raises(ValueError, match=f"estimator_profile: {path}: {what}"):
            load_estimator(SchedulerConfig(policy="slo", estimator_profile=str(path)), 1)
    with pytest.raises(ValueError, match=r"raw.json: sample decode\[0\]: missing field 'prefill_chunks'"):
        Measurements.load(no_field)
    with pytest.raises(ValueError, match="raw.json: not an estimator profile: missing field.*; unknown field"):
        EstimatorProfile.from_json(no_field)
    with pytest.raises(ValueError, match="not a profiler's raw samples.*no list prefill, hetero"):
        Measurements.load(_write(tmp_path / "d.json", '{"decode": []}'))
    with pytest.raises(ValueError, match=r"log.jsonl: not a text file"):
        Measurements.load(_write(tmp_path / "log.jsonl", b"\xff\xfe\x00garbage"))
    for path, what in ((binary, "not a text file"), (no_field, "missing field 'prefill_chunks'")):
        assert main(["profile", "--model", "tiny-llama", "--out", str(tmp_path / "p.json"),
                     "--fit-only", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"conflux profile: error: --fit-only {path}: ") and what in err, err
    assert EstimatorProfile.from_json(_roundtrip(tmp_path)) == TRUE  # a written profile still loads
    tile0 = tmp_path / "tile0.json"
    replace(TRUE, query_tile=2).to_json(tile0)
    tile0.write_text(tile0.read_text().replace('"query_tile": 2', '"query_tile": 0'))
    with pytest.raises(ValueError, match="tile0.json: estimator profile query_tile must be >= 1, got 0"):
        EstimatorProfile.from_json(tile0)


def _write(path, data):
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _roundtrip(tmp_path):
    TRUE.to_json(tmp_path / "true.json")
    return tmp_path / "true.json"


def test_refit_recovers_a_per_chunk_cost_from_steps_of_several_chunks():
    """κ_c: an engine that pays per prefill chunk (whatever its size). Steps of 1 to 8 chunks tell it
    from f_P's intercept; the fit without it misprices many-chunk steps."""
    from conflux_cluster.engine.scheduler.fitting.samples import refine_jointly
    from conflux_cluster.engine.scheduler.fitting.fit import profile_mape

    rng = random.Random(6)
    true = replace(TRUE, num_ranks=1, f_comm=Affine(0.0, 0.0), chunk_cost=3e-4)
    est = LatencyEstimator(true)

    def step(k: int) -> BatchSample:
        chunks = tuple((rng.choice([64, 256, 1024]), rng.choice([0, 2048, 8192])) for _ in range(k))
        d = rng.randint(0, 16)
        load = BatchLoad((sum(l for l, _ in chunks),), (d,), (d * 2048,), chunks)
        return BatchSample(load, est.estimate(load).total * rng.uniform(0.995, 1.005))

    samples = [step(rng.randint(1, 8)) for _ in range(160)]
    start = replace(true, chunk_cost=0.0, f_gemm=Affine(1e-7, 1e-4))
    fitted = refine_jointly(start, samples[::2])
    assert fitted.chunk_cost == pytest.approx(3e-4, rel=0.15)
    assert profile_mape(fitted, samples[1::2]) < 1.5
    assert profile_mape(replace(fitted, chunk_cost=0.0), samples[1::2]) > 5.0
