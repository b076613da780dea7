"""The `recall` policy's half of the cache (docs/spec.md, recall): every token is archived, and each step
refills `recall_slots` slots per KV head from the archive.

- `layer.py`: `RecallLayer` (an `H2OLayer` whose store holds the resident set S) and its C-step binding.
- `step.py`: the one-token recall step on the torch path.
- `archive.py`: `PageArchive` (built from `PageSettings`), the archive and its page choice, over
  `scores.py` (`PageScoring`: the page scores) over `store.py` (`ArchiveStore`: the ring, its writes and reads);
  `archive_file.py`: the archive in a file.
- `limits.py`: how much the archive may hold, and the checks of recall's options.
The policy itself (its slot split) is `h2o_cli/policies/recall.py`, like every policy.
"""
