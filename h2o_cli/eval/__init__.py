"""Evaluation: lm-evaluation-harness tasks scored through the H2O cache, long-context tasks, PPL comparisons."""
