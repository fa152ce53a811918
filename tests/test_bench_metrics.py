"""Bench metrics from a scripted run whose acceptance lengths and timings are known in advance."""

from __future__ import annotations

from dlite_trt.bench.metrics import RequestRecord, add_speedups, measure, paired_rounds, summarize
from dlite_trt.bench.report import goals, target_phrases
from dlite_trt.bench.run import _mismatches
from dlite_trt.runtime.session import StepEvent
from dlite_trt.runtime.stats import StepRecord


def _clock(times):
    it = iter(times)
    return lambda: next(it)


def _scripted_speculative():
    """Batch 1, K = 3: prefill (1 token), then steps accepting 2, 0 and 3 drafts, and a last
    step that accepted 3 but kept 2 (the output ended inside it: its drafts 7, 8)."""
    yield StepEvent(((5,),), None)
    yield StepEvent(((6, 7, 8),), StepRecord(((6, 7, 1),), (2,), (3,)))
    yield StepEvent(((9,),), StepRecord(((4, 4, 4),), (0,), (1,)))
    yield StepEvent(((1, 2, 3, 4),), StepRecord(((1, 2, 3),), (3,), (4,)))
    yield StepEvent(((7, 8),), StepRecord(((7, 8, 9),), (3,), (2,)))


def test_measure_a_scripted_speculative_request():
    record = measure(_scripted_speculative(), RequestRecord("w", "dlite", "t", 0, 1, 10),
                     clock=_clock([0.0, 1.0, 1.5, 1.75, 2.25, 2.5, 3.0]))
    assert record.output_ids == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 7, 8]]
    assert record.output_tokens == 11
    assert record.step_tokens == [3, 1, 4, 2]  # kept tokens: with the prefill's, the output length
    assert (record.proposed, record.accepted) == (12, 7)  # the cut step's 2 kept drafts, not its 3 accepted
    assert record.ttft_s == 1.0 and record.total_s == 3.0
    assert record.tpot_s == 2.0 / 10

    s = summarize([record], max_step_tokens=4)
    assert s["mean_acceptance_length"] == 10 / 4
    assert s["acceptance_histogram"] == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert s["acceptance_rate"] == 7 / 12
    assert s["tokens_per_second"] == 11 / 3.0
    assert s["steps"] == 4


def test_target_only_and_finished_rows():
    """Decode steps count one token per active row; rows that finished hold None in a record."""
    def events():
        yield StepEvent(((1,), (2,)), None)
        yield StepEvent(((3,), ()), None)  # row 1 finished
        yield StepEvent(((4, 5), ()), StepRecord(((4, 9), None), (1, None), (2, None)))

    record = measure(events(), RequestRecord("w", "x", "t", 0, 2, 3), clock=_clock([0.0, 0.5, 1.0, 2.0, 2.0]))
    assert record.step_tokens == [1, 2]
    assert record.output_tokens == 5
    assert (record.proposed, record.accepted) == (2, 1)
    assert record.tpot_s == (2.0 - 0.5) / (5 / 2 - 1)


def test_percentiles_over_requests():
    records = []
    for ttft in (1.0, 2.0, 3.0, 5.0):
        events = iter([StepEvent(((1,),), None), StepEvent(((2,),), None)])
        records.append(measure(events, RequestRecord("w", "ar", "t", 0, 1, 4),
                               clock=_clock([0.0, ttft, ttft + 1.0, ttft + 1.0])))
    s = summarize(records, max_step_tokens=1)
    # linear interpolation between order statistics: rank p/100 * (n - 1)
    assert s["ttft_s"] == {"p50": 2.5, "p90": 3.0 + 0.7 * 2.0, "p99": 3.0 + 0.97 * 2.0}
    assert s["tpot_s"] == {"p50": 1.0, "p90": 1.0, "p99": 1.0}
    assert s["mean_acceptance_length"] == 1.0 and s["acceptance_rate"] is None


def test_goals():
    def method(tps, al):
        return {"tokens_per_second": tps, "speedup_over_ar": tps / 100.0, "mean_acceptance_length": al}

    report = {"workloads": {"a": {"methods": {"ar": method(100.0, 1.0), "dlite": method(250.0, 3.0),
                                              "ngram": method(200.0, 2.0)}},
                            "b": {"methods": {"ar": method(100.0, 1.0), "dlite": method(150.0, 2.5),
                                              "ngram": method(200.0, 2.0)}}},
              "context_cost": {"step_profile": {"256": {"draft_ms": 2.0}, "16384": {"draft_ms": 2.25}}}}
    g = goals(report)
    assert g["a"]["speedup_over_al"] == 2.5 / 3.0 and g["a"]["speedup_at_least_0.8_al"]
    assert g["a"]["ahead_of_ngram"] and g["a"]["dlite_over_ngram"] == 1.25
    assert not g["b"]["speedup_at_least_0.8_al"] and not g["b"]["ahead_of_ngram"]
    assert g["draft_time_flat"] == {"contexts": [256, 16384], "ratio": 1.125, "within_10_percent": False}


def test_dlite_ngram_is_judged_against_the_lookup_alone_and_the_step_call_at_the_shortest_context():
    def method(tps, decode_tps):
        return {"tokens_per_second": tps, "decode_tokens_per_second": decode_tps, "speedup_over_ar": tps / 100.0,
                "mean_acceptance_length": 2.0}

    calls = {"2048": {"step_over_decode": 1.40, "verify_width": 4}, "256": {"step_over_decode": 1.20, "verify_width": 3}}
    report = {"workloads": {"a": {"methods": {"ar": method(100.0, 110.0), "dlite": method(120.0, 140.0),
                                              "ngram": method(150.0, 200.0), "dlite-ngram": method(149.0, 210.0)}}},
              "context_cost": {"call_times": calls}}
    targets = goals(report)["a"]["targets"]
    lookup = targets["dlite-ngram"]["at_least_ngram"]
    assert (lookup["fastest"], lookup["need"]) == ("ngram", 1.0)
    assert lookup["ratio"] == 149.0 / 150.0 and lookup["decode_phase_ratio"] == 210.0 / 200.0
    assert "at_least_ngram" not in targets["dlite"]  # DLite alone answers to the 1.3x goal over the lookup
    assert targets["dlite"]["over_ngram"]["ratio"] == 120.0 / 150.0
    assert goals(report)["step_call_over_decode"] == {"context": 256, "verify_width": 3, "ratio": 1.20,
                                                      "need": 1.25, "met": True}
    calls["256"]["step_over_decode"] = 1.3
    assert goals(report)["step_call_over_decode"]["met"] is False


def _workload_goals(step_s: dict[str, list[float]], al: dict[str, int]) -> dict:
    """One workload's goals from planted timings: per method, one 96-token request per task
    (round), a 0.1 s prefill and decode steps of ``step_s[method][task]`` seconds, each keeping
    ``al[method]`` tokens; summarized as run_workload does."""
    records = {}
    for method, steps in step_s.items():
        records[method] = []
        for task, s in enumerate(steps):
            r = RequestRecord("w", method, f"t{task}", 0, 1, 100, output_tokens=96, ttft_s=0.1)
            r.step_tokens = [al[method]] * (95 // al[method])
            r.total_s = 0.1 + s * len(r.step_tokens)
            records[method].append(r)
    rows = {method: summarize(rs, max_step_tokens=8) for method, rs in records.items()}
    add_speedups(rows)
    for method, rounds in paired_rounds(records).items():
        rows[method]["paired"] = rounds
    return goals({"workloads": {"w": {"methods": rows}}, "engine": {"weights": {"format": "float"}}})["w"]


def test_impossible_step_times_and_noisy_rounds_are_not_judged():
    ar = [0.05] * 6
    # a DLite step planted at half a decode step: faster than physics allows, so not judged
    g = _workload_goals({"ar": ar, "dlite": [0.025] * 6}, {"ar": 1, "dlite": 3})
    assert g["noise"]["dlite"]["impossible"] and g["noise"]["dlite"]["step_time_over_ar"] == 0.5
    assert g["targets"]["dlite"]["over_ar"]["met"] is None and "physics" in g["noise"]["dlite"]["summary"]
    # the same AL at 1.3x a decode step, every round alike: judged (3 x 0.05 / 0.065 = 2.3x >= 2)
    g = _workload_goals({"ar": ar, "dlite": [0.065] * 6}, {"ar": 1, "dlite": 3})
    assert not g["noise"]["dlite"]["impossible"] and g["noise"]["dlite"]["round_spread"] < 1e-9
    assert g["targets"]["dlite"]["over_ar"]["met"] is True
    # rounds from 1.0x to 2.2x a decode step: a ratio near 2.0 is inside the noise, so not judged
    g = _workload_goals({"ar": ar, "dlite": [0.05, 0.06, 0.07, 0.08, 0.09, 0.11]}, {"ar": 1, "dlite": 3})
    assert g["noise"]["dlite"]["round_spread"] > abs(g["targets"]["dlite"]["over_ar"]["ratio"] / 2.0 - 1)
    assert g["targets"]["dlite"]["over_ar"]["met"] is None
    # clean but only two rounds: too few to tell noise
    g = _workload_goals({"ar": ar[:2], "dlite": [0.065] * 2}, {"ar": 1, "dlite": 3})
    assert g["targets"]["dlite"]["over_ar"]["met"] is None and "too few" in g["noise"]["dlite"]["summary"]


def test_speedups_and_host_draft_share():
    rows = {"ar": {"tokens_per_second": 100.0, "decode_tokens_per_second": 50.0},
            "ngram": {"tokens_per_second": 150.0, "decode_tokens_per_second": 100.0}}
    add_speedups(rows)
    assert rows["ngram"]["speedup_over_ar"] == 1.5 and rows["ngram"]["decode_speedup_over_ar"] == 2.0
    assert rows["ar"]["speedup_over_ar"] == 1.0

    record = measure(_scripted_speculative(), RequestRecord("w", "ngram", "t", 0, 1, 10),
                     clock=_clock([0.0, 1.0, 1.5, 1.75, 2.25, 2.5, 3.0]))
    record.stage_s = {"draft": 0.375, "draft_context": 0.25, "verify": 1.0}  # draft_context is prefill work
    s = summarize([record], max_step_tokens=4)
    assert s["host_draft_share"] == 0.375 / 2.0  # drafting during the 2 s after the first token
    assert s["decode_tokens_per_second"] == 10 / 2.0
    assert s["draft_context_s"] == 0.25


def test_mismatches_are_counted():
    def record(task, turn, ids):
        r = RequestRecord("w", "x", task, turn, 1, 3)
        r.output_ids = ids
        return r

    baseline = [record("a", 0, [[1, 2]]), record("a", 1, [[3]]), record("b", 0, [[4, 5]])]
    same = [record("a", 0, [[1, 2]]), record("a", 1, [[3]]), record("b", 0, [[4, 5]])]
    assert _mismatches(same, baseline) == {"checked": 3, "mismatches": 0, "first": [], "expected_identical": True,
                                           "divergence_index": {}}
    off = [record("a", 0, [[1, 2]]), record("a", 1, [[9]]), record("b", 0, [[4, 5]])]
    assert _mismatches(off, baseline) == {"checked": 3, "mismatches": 1, "first": ["a/turn 1"], "expected_identical": True,
                                          "divergence_index": {"a/turn 1": 0}}
    longer = [record("a", 0, [[1, 2, 7]]), record("a", 1, [[3]]), record("b", 0, [[4, 6]])]
    assert _mismatches(longer, baseline, exact=False)["divergence_index"] == {"a/turn 0": 2, "b/turn 0": 1}
    assert _mismatches(off, None)["mismatches"] is None


def test_each_method_starts_a_round_and_follows_others_in_turn():
    """The bench's rounds: every method once per task, each starting one task in turn, and the
    method before another one changes between consecutive tasks (forward, then backward)."""
    from dlite_trt.bench.run import round_order

    methods = ["ar", "dlite", "ngram", "dlite-ngram", "hf"]
    orders = [round_order(methods, i) for i in range(len(methods))]
    assert all(sorted(o) == sorted(methods) for o in orders)
    assert [o[0] for o in orders] == methods
    before = [{b: a for a, b in zip(o, o[1:])} for o in orders]
    assert before[0]["dlite-ngram"] == "ngram" and before[1]["dlite-ngram"] == "hf"
    for now, then in zip(before, before[1:]):  # consecutive tasks: another method before each
        assert all(now[m] != then[m] for m in methods if m in now and m in then), (now, then)


def test_goals_on_the_same_ratio_print_it_once_with_each_need():
    targets = {"over_ngram": {"fastest": "ngram", "ratio": 1.46, "need": 1.3, "met": True, "decode_phase_ratio": 1.5},
               "at_least_ngram": {"fastest": "ngram", "ratio": 1.46, "need": 1.0, "met": None},
               "over_ar": {"fastest": "ar", "ratio": 1.9, "need": 2.0, "met": False}}
    phrases = target_phrases(targets)
    assert phrases.count("1.46x") == 1 and phrases.count("1.90x") == 1
    assert "(need 1.3: met; need 1.0: not judged" in phrases and "decode phase 1.50x)" in phrases
    assert "(need 2.0: NOT met)" in phrases
