"""Estimator model, profiles (budget, roofline, JSON) and fitting from synthetic measurements."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from conflux_cluster.engine.scheduler.estimator import (Affine, BatchLoad, EstimatorProfile, LatencyEstimator,
                                                        budget_profile, prefill_attn_work, prefill_kv_tokens)
from conflux_cluster.engine.scheduler.fitting.fit import (BatchSample, ComponentSamples, fit_affine, fit_contention,
                                                  fit_profile, mape, profile_mape)
from conflux_cluster.engine.scheduler.roofline import H100, H200, MODELS, roofline_profile

TRUE = EstimatorProfile(model="m", hardware="synthetic", num_ranks=4, num_layers=32,
                        f_gemm=Affine(1.5e-7, 6e-5), f_prefill_attn=Affine(3e-11, 8e-6),
                        f_decode_attn=Affine(1.0e-9, 6e-6), f_comm=Affine(5e-8, 9e-5), alpha=1.25, beta=1.1,
                        f_prefill_kv=Affine(2e-9, 0.0), cobatch=3e-4)


def random_batch(rng, n=4):
    chunks = tuple((rng.randint(32, 10000), rng.randint(0, 16000)) for _ in range(rng.randint(1, 3)))
    total = sum(l for l, _ in chunks)
    pre = [total // n + (1 if r < total % n else 0) for r in range(n)]
    dec = [rng.randint(1, 128) // n + 1 for _ in range(n)]
    ctx = [d * rng.randint(1000, 16000) for d in dec]
    return BatchLoad(tuple(pre), tuple(dec), tuple(ctx), chunks)


def test_iteration_time_matches_estimate():
    est, rng = LatencyEstimator(TRUE), random.Random(1)
    for _ in range(50):
        b = random_batch(rng)
        fast = est.iteration_time(max(p + d for p, d in zip(b.prefill_tokens, b.decode_tokens)),
                                  max(b.prefill_tokens), prefill_attn_work(b.prefill_chunks),
                                  est.decode_time(b.decode_context, b.decode_tokens),
                                  prefill_kv_tokens(b.prefill_chunks), any(b.decode_tokens))
        assert fast == pytest.approx(est.estimate(b).total, rel=1e-12)


def test_cobatch_overhead_is_paid_only_by_steps_with_both_phases():
    est = LatencyEstimator(TRUE)
    mixed = BatchLoad((256,) * 4, (8,) * 4, (8000,) * 4, ((1024, 0),))
    prefill_only = replace(mixed, decode_tokens=(0,) * 4, decode_context=(0,) * 4)
    decode_only = replace(mixed, prefill_tokens=(0,) * 4, prefill_chunks=())
    plain = LatencyEstimator(replace(TRUE, cobatch=0.0))
    assert est.estimate(mixed).total - plain.estimate(mixed).total == pytest.approx(32 * 3e-4)
    assert est.estimate(prefill_only).total == plain.estimate(prefill_only).total
    assert est.estimate(decode_only).total == plain.estimate(decode_only).total


def test_fit_affine_recovers_coefficients_with_noise():
    rng = random.Random(0)
    xs = [rng.uniform(1, 8192) for _ in range(200)]
    ys = [(2e-7 * x + 5e-5) * rng.uniform(0.98, 1.02) for x in xs]
    f = fit_affine(xs, ys)
    assert f.slope == pytest.approx(2e-7, rel=0.03) and f.intercept == pytest.approx(5e-5, rel=0.05)


def test_fit_profile_recovers_true_model_and_contention():
    rng = random.Random(2)

    def noisy(f, lo, hi):
        return [(x, f(x) * rng.uniform(0.99, 1.01)) for x in (rng.uniform(lo, hi) for _ in range(60))]

    samples = ComponentSamples(gemm=noisy(TRUE.f_gemm, 1, 8192), prefill_attn=noisy(TRUE.f_prefill_attn, 1e3, 3e7),
                               decode_attn=noisy(TRUE.f_decode_attn, 1e3, 5e5), comm=noisy(TRUE.f_comm, 8, 4096))
    est = LatencyEstimator(replace(TRUE, cobatch=0.0))  # the component-wise fit is Eq. 2's (no κ)
    batches = [BatchSample(b, est.estimate(b).total * rng.uniform(0.99, 1.01))
               for b in (random_batch(rng) for _ in range(120))]
    fitted = fit_profile(samples, batches[:80], model="m", hardware="synthetic", num_ranks=4, num_layers=32)
    for name in ("f_gemm", "f_prefill_attn", "f_decode_attn", "f_comm"):
        got, want = getattr(fitted, name), getattr(TRUE, name)
        assert got.slope == pytest.approx(want.slope, rel=0.05), name
        assert got.intercept == pytest.approx(want.intercept, rel=0.1, abs=1e-7), name
    assert fitted.alpha == pytest.approx(1.25, abs=0.05) and fitted.beta == pytest.approx(1.1, abs=0.05)
    assert profile_mape(fitted, batches[80:]) < 2.0  # held out
    assert profile_mape(replace(fitted, alpha=1.0, beta=1.0), batches[80:]) > profile_mape(fitted, batches[80:])


def test_fit_contention_clamps_at_one():
    est = LatencyEstimator(replace(TRUE, alpha=1.0, beta=1.0))
    rng = random.Random(3)
    batches = [BatchSample(b, est.estimate(b).total * 0.8) for b in (random_batch(rng) for _ in range(30))]
    a, b = fit_contention(replace(TRUE, alpha=1.0, beta=1.0), batches)
    assert a >= 1.0 and b >= 1.0


def test_mape():
    assert mape([1.1, 0.9], [1.0, 1.0]) == pytest.approx(10.0)


def test_profile_json_roundtrip(tmp_path):
    p = roofline_profile("qwen3-32b", H200, 4, tp=2)
    p.to_json(tmp_path / "p.json")
    q = EstimatorProfile.from_json(tmp_path / "p.json")
    assert q == p


def test_budget_profile_reaches_tbt_at_token_budget():
    est = LatencyEstimator(budget_profile(0.05, 512, 2))
    assert est.iteration_time(512, 256, 1e9, 0.0) == pytest.approx(0.05)
    assert est.iteration_time(1024, 0, 0.0, 0.0) > 0.05


def test_roofline_matches_measured_h200_gemm_order_of_magnitude():
    """DESIGN §6: one 14336x4096 bf16 linear at 4096 tokens took 613 µs on the H200 host."""
    m = MODELS["llama-3.1-8b"]
    flops_one_linear = 2 * 4096 * 14336 * 4096
    t = flops_one_linear / (H200.peak_flops * H200.gemm_efficiency)
    assert t == pytest.approx(613e-6, rel=0.05)
    p8, p1 = roofline_profile(m, H200, 8), roofline_profile(m, H100, 1)
    assert p8.f_comm.slope > 0 and p1.f_comm == Affine(0.0, 0.0)
    assert roofline_profile(m, H100, 4).f_decode_attn.slope > roofline_profile(m, H200, 4).f_decode_attn.slope


def test_roofline_prefill_kv_read_term():
    """Reading 16K tokens of history costs a short chunk more than its FLOPs (memory-bound)."""
    off = LatencyEstimator(roofline_profile("llama-3.1-8b", H200, 2))
    on = LatencyEstimator(roofline_profile("llama-3.1-8b", H200, 2, prefill_kv_read=True))
    short_long_history = BatchLoad((16, 16), (0, 0), (0, 0), ((32, 16384),))
    extra = on.estimate(short_long_history).prefill_attn - off.estimate(short_long_history).prefill_attn
    bytes_per_rank = (16384 + 32) / 2 * 2 * 8 * 128 * 2  # Σ(c+ℓ)/N tokens x K and V of 8 kv heads, bf16
    assert extra == pytest.approx(32 * bytes_per_rank / (H200.hbm_bandwidth * H200.hbm_efficiency), rel=1e-9)
    assert extra > 0.5 * off.estimate(short_long_history).prefill_attn  # not negligible for short chunks
    big = BatchLoad((4096, 4096), (0, 0), (0, 0), ((8192, 0),))
    assert on.estimate(big).total == pytest.approx(off.estimate(big).total, rel=0.02)
