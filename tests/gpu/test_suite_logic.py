#!/usr/bin/env python3
"""The GPU suite's logic without a GPU: rows are independent, a failure
that also happens without gemini is the row's own, the report carries
both runs. Run by `make test` (tests/tests/it/gpu_suite.rs)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_suite as s  # noqa: E402


def row(hook, plain, hook_ok=lambda h: h["v"] > 0, plain_ok=lambda p: p["v"] > 0):
    """A row whose sides return {"v": ...} or raise what they are given."""

    def run(hooked, h):
        side = hook if hooked else plain
        if isinstance(side, Exception):
            raise side
        return side

    def judge(h, p):
        return s.Result(f"v={h['v']}", p and f"v={p['v']}", "v > 0", hook_ok(h), p and plain_ok(p))

    return run, judge


class Rows(unittest.TestCase):
    def test_a_row_that_passes_under_gemini_passes(self):
        r, v = s.run_row("x", row({"v": 1}, {"v": 1}))
        self.assertEqual(v, s.PASS)
        self.assertEqual((r.hook, r.plain), ("v=1", "v=1"))

    def test_a_row_that_fails_only_under_gemini_is_gemini_s_failure(self):
        _, v = s.run_row("x", row({"v": 0}, {"v": 1}))
        self.assertEqual(v, s.FAIL)

    def test_a_row_that_fails_both_ways_is_the_row_s_own(self):
        _, v = s.run_row("x", row({"v": 0}, {"v": 0}))
        self.assertEqual(v, s.OWN)

    def test_an_exception_both_ways_is_the_row_s_own(self):
        r, v = s.run_row("x", row(s.WorkerError("boom"), s.WorkerError("boom too")))
        self.assertEqual(v, s.OWN)
        self.assertIn("boom", r.hook)
        self.assertIn("boom too", r.plain)

    def test_an_exception_under_gemini_alone_is_gemini_s_failure(self):
        r, v = s.run_row("x", row(RuntimeError("hook broke it"), {"v": 1}))
        self.assertEqual(v, s.FAIL)
        self.assertIn("hook broke it", r.hook)
        self.assertEqual(r.plain, "v=1")

    def test_an_exception_without_gemini_leaves_the_hooked_verdict(self):
        r, v = s.run_row("x", row({"v": 1}, RuntimeError("plain broke")))
        self.assertEqual(v, s.PASS)
        self.assertIn("plain broke", r.plain)

    def test_a_row_without_a_judgement_is_measured(self):
        _, v = s.run_row("x", row({"v": 0}, {"v": 0}, hook_ok=lambda h: None))
        self.assertEqual(v, s.INFO)

    def test_a_skipped_framework_is_skipped(self):
        r, v = s.run_row("x", row({"skipped": "no numba"}, {"skipped": "no numba"}))
        self.assertEqual(v, s.SKIP)
        self.assertIn("no numba", r.hook)

    def test_the_plain_side_sees_the_hooked_result(self):
        seen = []

        def run(hooked, h):
            seen.append(h)
            return {"v": 1}

        s.run_row("x", (run, row({"v": 1}, {"v": 1})[1]))
        self.assertEqual(seen, [None, {"v": 1}])


class Reports(unittest.TestCase):
    def test_the_report_carries_both_runs_and_counts_only_gemini_s_failures(self):
        rep = s.Report()
        for name, hook, plain in (("ok", {"v": 1}, {"v": 1}), ("own", {"v": 0}, {"v": 0}), ("bad", {"v": 0}, {"v": 1}), ("crash", RuntimeError("x|y"), {"v": 1})):
            rep.add(name, *s.run_row(name, row(hook, plain)))
        self.assertEqual(rep.failures(), ["bad", "crash"])
        md = rep.markdown("## header")
        self.assertIn("| with gemini | without gemini |", md)
        self.assertIn("| own | v=0 | v=0 | v > 0 | fails without gemini too |", md)
        self.assertIn("x\\|y", md)
        self.assertIn("pass: 1, FAIL: 2, fails without gemini too: 1", md)


if __name__ == "__main__":
    unittest.main()
