"""Decode speed of `h2o chat` in a pseudo-terminal with the live panel on vs --no-panel.

Usage: python research/bench_chat_panel.py [--tokens 64] [--rounds 2] [--budget 256] [--threads 1] [--policy h2o]
Prints the tok/s the chat reports after each answer, alternating panel on / off.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pexpect

REPO = Path(__file__).resolve().parent.parent


def one_run(panel: bool, tokens: int, budget: int, threads: int, policy: str) -> float:
    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm-256color", OMP_WAIT_POLICY="PASSIVE")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "kernels")])
    args = ["-c", "from h2o_cli.cli.app import main; main()", "chat", "--budget", str(budget)]
    args += ["--policy", policy]
    args += ["-n", str(tokens), "--threads", str(threads)] + ([] if panel else ["--no-panel"])
    child = pexpect.spawn(
        sys.executable,
        args,
        env=env,
        encoding="utf-8",
        dimensions=(50, 140),
        timeout=600,
        searchwindowsize=4000,
    )
    child.expect_exact(">>>")
    child.sendline("Write a long story about a dragon who learns to bake bread.")
    child.expect(r"(\d+) tokens · ([\d.]+) tok/s")
    rate = float(child.match.group(2))
    child.expect_exact(">>>")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--policy", default="h2o", help="e.g. recall: its panel also draws the recalled tokens"
    )
    options = parser.parse_args()
    rates = {True: [], False: []}
    for _ in range(options.rounds):
        for panel in (True, False):
            rates[panel].append(
                one_run(panel, options.tokens, options.budget, options.threads, options.policy)
            )
            print(f"panel {'on ' if panel else 'off'}: {rates[panel][-1]:.2f} tok/s", flush=True)
    on, off = (sum(rates[p]) / len(rates[p]) for p in (True, False))
    print(f"mean: panel on {on:.2f} tok/s, off {off:.2f} tok/s, ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
