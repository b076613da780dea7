"""Chat over the H2O cache: a session that keeps a conversation on rolling positions, and cache snapshots."""

from h2o_cli.chat.session import ChatSession, Turn, read_transcript
from h2o_cli.chat.snapshot import CacheSnapshot, take_snapshot

__all__ = ["CacheSnapshot", "ChatSession", "Turn", "read_transcript", "take_snapshot"]
