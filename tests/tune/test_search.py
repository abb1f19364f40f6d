"""The search, on injected fits() with exact expected answers (no model involved)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actune.tune.search import Probe, largest_fitting


def linear(limit: int, per: int = 10, base: int = 100):
    """A trial whose peak grows by ``per`` bytes a sample; fits while peak <= budget."""
    budget = base + per * limit

    def trial(n: int) -> Probe:
        peak = base + per * n
        return Probe(n, peak <= budget, peak)

    return trial, budget


@given(limit=st.integers(1, 5000), start=st.integers(1, 64), step=st.sampled_from([1, 4, 8]))
def test_bracket_and_bisect_finds_the_exact_largest_multiple(limit, start, step):
    trial, _ = linear(limit)
    result = largest_fitting(lambda n: Probe(n, trial(n).fits), start=start, step=step)
    expected = limit // step * step
    assert result.value == (expected if expected >= step else None)
    assert len(result.probes) <= 2 * (limit.bit_length() + 2)


@given(limit=st.integers(2, 100000), step=st.sampled_from([1, 8]))
def test_prediction_from_peaks_needs_at_most_four_probes_on_a_line(limit, step):
    trial, budget = linear(limit)
    result = largest_fitting(trial, start=1, step=step, budget=budget)
    expected = limit // step * step
    assert result.value == (expected if expected >= step else None)
    if expected >= 2 * step:
        assert len(result.probes) <= 4


def test_nothing_fits():
    result = largest_fitting(lambda n: Probe(n, False), start=8)
    assert result.value is None
    assert [p.size for p in result.probes] == [8, 1]


def test_max_caps_and_says_so():
    result = largest_fitting(lambda n: Probe(n, True), start=1, maximum=100)
    assert result.value == 100 and result.capped


def test_interrupt_returns_the_best_so_far():
    def trial(n):
        if n > 16:
            raise KeyboardInterrupt
        return Probe(n, True)

    result = largest_fitting(trial, start=1)
    assert result.value == 16 and not result.complete


def test_errors_other_than_out_of_memory_propagate():
    def trial(n):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        largest_fitting(trial)


@given(limit=st.integers(20, 50000), curve=st.floats(0.0, 3.0))
def test_prediction_on_a_curved_peak_is_exact_and_cheap(limit, curve):
    """A fixed cost that bends the line at small sizes (as real peaks do) still ends at the
    exact answer, in far fewer probes than bisection would need."""

    def peak(n):
        return 1000 + 10 * n + curve * 2000 * min(n, 16) ** 0.5

    budget = peak(limit)
    result = largest_fitting(lambda n: Probe(n, peak(n) <= budget, peak(n)), start=8,
                             budget=budget)
    assert result.value == limit
    assert len(result.probes) <= 8  # bisection alone would need up to 26


def interpolated(peaks: dict[int, int]):
    """Peak bytes at any size from recorded ones: exact where recorded, linear between."""
    sizes = sorted(peaks)

    def peak(n: int) -> float:
        if n in peaks:
            return peaks[n]
        a = max(s for s in sizes if s < n)
        b = min(s for s in sizes if s > n)
        return peaks[a] + (peaks[b] - peaks[a]) * (n - a) / (b - a)

    return peak


# Peaks measured on an H200 (torch.cuda.max_memory_allocated) for ResNet-50 at L0, 224x224,
# by the bisection the measure mode used to run; 16 GiB budget, answer 194.
H200_RESNET50_L0 = {8: 1028782592, 16: 1717368832, 32: 3070294016, 64: 5853181952,
                    128: 11389532672, 192: 16955112448, 194: 17118821888, 195: 17220013568,
                    196: 17281072640, 200: 17650236928, 208: 18350210560, 224: 19732069888,
                    256: 22482943488}


def test_measured_peaks_are_predicted_from_too():
    """Measure mode reports peaks like estimate mode, so its search predicts from them: on the
    measured H200 peaks (interpolated between the sizes that were run) it reaches the same
    answer in 4 trials where bisection took 13."""
    from actune.memory.budget import Budget
    from actune.tune.run import Settings

    peak = interpolated(H200_RESNET50_L0)
    settings = Settings(Budget(16 << 30, "given with --budget"), mode="measure", device="cuda")
    budget = settings.search_budget
    result = largest_fitting(lambda n: Probe(n, peak(n) <= budget, int(peak(n))), start=8,
                             budget=budget)
    assert result.value == 194
    assert [p.size for p in result.probes] == [8, 16, 195, 194]
    bisect = largest_fitting(lambda n: Probe(n, peak(n) <= budget), start=8)
    assert bisect.value == 194 and len(bisect.probes) == 13


# Estimated peaks of ResNet-50 at L3, 224x224 (`actune maxbatch --model resnet50 --budget
# 16GiB`): small batches peak in backward, large ones in forward, so the line through the
# first two probes overshoots; answer 1,172.
RESNET50_L3 = {8: 410724072, 16: 515435240, 1171: 17162261224, 1172: 17176739048,
               1173: 17191221992, 1230: 18016651496, 1289: 18871053032}


def test_two_adjacent_fitting_sizes_give_the_local_slope():
    """Once a prediction and the size after it both fit, the line through those two (the
    slope where the answer is) predicts the last step; no bisection of the bracket."""
    peak = interpolated(RESNET50_L3)
    budget = 16 << 30
    result = largest_fitting(lambda n: Probe(n, peak(n) <= budget, int(peak(n))), start=8,
                             budget=budget)
    assert result.value == 1172
    assert [p.size for p in result.probes] == [8, 16, 1289, 1171, 1172, 1173]


# Estimated peaks of ResNet-152 at L3, batch 64, by input resolution (`actune scale --dim
# resolution --model resnet152 --batch 64 --budget 16GiB`), step 8: the peak bends upwards
# (it grows with the square of the resolution), so the slope between two neighbouring fitting
# sizes points past the answer; answer 872.
RESNET152_L3_RESOLUTION = {
    224: 1566520856, 448: 4818076184, 776: 13619892248, 784: 13759889944, 872: 17053290008,
    880: 17210520088, 888: 17664195608, 896: 17824297496, 904: 18286233624, 912: 18449207832,
    920: 18919258648, 928: 19085104664, 936: 19563416088, 944: 19732134424, 952: 20218560536,
    960: 20390150680, 968: 20884837400, 976: 21059299864, 1296: 36764090904}


def test_a_local_slope_that_points_past_a_failed_size_is_dropped():
    """Once the local slope has predicted a size that did not fit, the bracket's own line
    takes over: the search does not walk down from the failed size one step at a time (it
    took 19 trials that way)."""
    peak = interpolated(RESNET152_L3_RESOLUTION)
    budget = 16 << 30
    result = largest_fitting(lambda n: Probe(n, peak(n) <= budget, int(peak(n))), start=224,
                             step=8, budget=budget)
    assert result.value == 872
    assert len(result.probes) <= 9, [p.size for p in result.probes]


@given(increments=st.lists(st.integers(0, 1000), min_size=4, max_size=400),
       fraction=st.floats(0.0, 1.2), start=st.integers(1, 64), step=st.sampled_from([1, 4, 8]))
def test_prediction_is_exact_on_any_monotone_peaks(increments, fraction, start, step):
    """Peaks that grow in any steps (flat runs, jumps, bends either way): the answer is the
    exact largest fitting multiple of the step, whatever the lines predict on the way, and no
    size is tried twice."""
    peaks = [1000]
    for inc in increments:
        peaks.append(peaks[-1] + inc)
    budget = int(peaks[0] + fraction * (peaks[-1] - peaks[0]))

    def peak(n: int) -> int:  # beyond the recorded sizes the last increment repeats
        extra = max(0, n - len(peaks) + 1) * (increments[-1] + 1)
        return peaks[min(n, len(peaks) - 1)] + extra

    result = largest_fitting(lambda n: Probe(n, peak(n) <= budget, peak(n)), start=start,
                             step=step, budget=budget)
    expected, n = None, step  # peaks grow past the recorded sizes, so this scan ends
    while peak(n) <= budget or n < len(peaks):
        expected = n if peak(n) <= budget else expected
        n += step
    assert result.value == expected
    sizes = [p.size for p in result.probes]
    assert len(sizes) == len(set(sizes))


@given(limit=st.integers(2, 100000), base=st.integers(0, 10**6), step=st.sampled_from([1, 8]))
def test_one_probe_and_the_bytes_that_do_not_grow_predict_a_line(limit, base, step):
    """With the size-independent bytes of a probe (parameters, gradients, optimizer state),
    one probe gives the line: the answer and its neighbour are the only other trials."""
    per = 10
    budget = base + per * limit

    def trial(n: int) -> Probe:
        return Probe(n, base + per * n <= budget, base + per * n, fixed=base)

    result = largest_fitting(trial, start=step, step=step, budget=budget)
    expected = limit // step * step
    assert result.value == (expected if expected >= step else None)
    if expected >= 2 * step:
        assert len(result.probes) <= 3


# Estimated peaks of a small MLP at a 2-bit level (storages rounded up to 512 bytes, so the
# slope between two neighbouring batches is coarse): the local slope kept falling short and
# the search walked the bracket two trials at a time (22 trials); answer 2,344.
MLP_U2 = {8: 3425360, 1371: 10756688, 1372: 10761808, 1858: 13769808, 1859: 13775440,
          2102: 15275600, 2103: 15281232, 2224: 16028752, 2225: 16040016, 2290: 16435792,
          2291: 16441424, 2318: 16613968, 2319: 16619600, 2332: 16700496, 2333: 16706128,
          2339: 16744528, 2340: 16749648, 2342: 16760400, 2343: 16766032, 2344: 16771152,
          2345: 16782416, 2546: 18017872, 5000: 33000000}


def test_a_local_slope_that_falls_short_is_used_once():
    peak = interpolated(MLP_U2)
    budget = 16 << 20
    result = largest_fitting(lambda n: Probe(n, peak(n) <= budget, int(peak(n)), 3346992),
                             start=8, budget=budget)
    assert result.value == 2344
    assert len(result.probes) <= 8, [p.size for p in result.probes]


def test_a_peak_set_by_the_optimizer_step_does_not_send_the_search_far():
    """A large model's peak at a small batch is its optimizer's step (``fixed`` plus almost
    nothing); the activations, gone by then, are what grows. A line from (0, fixed) through
    that peak would point to batches hundreds of times too large, each a probe of minutes
    (a 1B-shaped Llama at 1,024 tokens): the search takes a second size instead."""
    fixed = 100_000

    def trial(n: int) -> Probe:
        activations = 5_000 * n
        peak = max(fixed + 16, 60_000 + activations)  # optimizer step, or forward/backward
        return Probe(n, peak <= 200_000, peak, fixed=fixed, grows=activations)

    result = largest_fitting(trial, start=8, budget=200_000)
    assert result.value == 28
    assert max(p.size for p in result.probes) <= 4 * 28
