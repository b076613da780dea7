"""Text shipped with h2o, so a fresh install has something to read: `h2o stream --sample`."""

from __future__ import annotations

from pathlib import Path

SAMPLE_TEXT = Path(__file__).resolve().parent / "frankenstein_pg84.txt"
"""Mary Shelley's *Frankenstein* (Project Gutenberg eBook #84, public domain; SOURCE.txt beside it)."""
