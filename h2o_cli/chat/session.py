"""A conversation over one H2O cache, on rolling positions: it can run far past the context window.

Each turn feeds only its new tokens (the cache already holds the earlier turns): the template text for the
user message and the assistant header, then the generated answer token by token, then the end-of-turn text.
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from h2o_cli.cache import H2OCache
from h2o_cli.chat.framing import answer_suffix, frame_flags, stop_ids, turn_parts
from h2o_cli.config import CacheSettings
from h2o_cli.errors import InputError
from h2o_cli.generation import Sampling, TextStreamer, generate_ids
from h2o_cli.private import write_private
from h2o_cli.prompting import NewChunk
from h2o_cli.streaming import prefill

# With `keep_frame`, the template's tokens pinned take at most this share of the resident slots: the first
# turn's header (the system message) always, then the newest turns' markers, the oldest released first.
FRAME_SHARE = 8  # 1/8: 102 of the 819 slots of SmolLM2's default budget

# Tokens per forward call when feeding a turn. The cache attends them `settings.chunk` at a time (its spare
# slots), so a chat can keep few spare slots and still read a long message in few forward calls.
FEED_CALL_TOKENS = 256
CHAT = "chat"  # `extra["kind"]` of a saved read made by `save_read`


@dataclass
class Turn:
    """One message. `start`: token index where its framed text begins in the stream; `end`: one past it."""

    role: str
    content: str
    start: int
    end: int = -1


@dataclass
class AnswerStats:
    """Figures of the last answer."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stopped: str = ""  # "stop" (end token), "length" (max tokens), "interrupted"

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class ChatSession:
    """Model, tokenizer, cache and transcript of one conversation.

    `send(text)` yields the answer's text pieces as they are generated. Set `stop_requested` (e.g. from a
    SIGINT handler) to end the current answer after the token in flight; the cache stays consistent.
    """

    model: object
    tokenizer: object
    settings: CacheSettings
    sampling: Sampling = field(default_factory=Sampling)
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)
    stop_requested: bool = False
    compiled: bool = False  # answers decode on the captured one-token forward (`--compile`, h2o_cli.compiled)
    keep_frame: bool = False  # pin the template's tokens (`frame`) in the cache: no policy evicts them

    def __post_init__(self) -> None:
        self.cache = H2OCache(self.model, self.settings)
        self._step = None  # the `CompiledStep` of `self.cache`, made on the first answer
        # Every token id fed, by token index (for re-reading and decoding heavy hitters).
        self.ids = array("l")
        # Token indices of the chat template's tokens fed (role markers, turn ends, the system message).
        self.frame = array("l")
        self.resumed_from = None  # the save `load_read` went on from (checked before a save is written)
        self.last = AnswerStats()
        self.started = time.time()
        self._suffix = answer_suffix(self.tokenizer, self.system)
        self._stops = stop_ids(self.tokenizer, self._suffix)

    @property
    def history(self) -> list[dict]:
        return [{"role": turn.role, "content": turn.content} for turn in self.turns]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _feed(self, pieces: list[list[int]], frame: list[bool] | None = None) -> torch.Tensor | None:
        """Run id lists through the cache in chunks (a `NewChunk` piece is a question: `streaming.chunks_of`);
        returns the logits after the last id. `frame`: which of the ids (all pieces in turn) are the
        template's (`frame_flags`), recorded in `frame`. A read cut short (Ctrl-C, context overflow) raises: a
        turn is fed whole or the caller hears why."""
        first = self.cache.tokens_seen
        new = [first + offset for offset, flag in enumerate(frame or ()) if flag]
        self.frame.extend(new)
        if self.keep_frame and new:
            self._pin_frame(self.cache)
        logits, stats = prefill(self.model, self.cache, pieces, FEED_CALL_TOKENS)
        self.ids.extend([token for piece in pieces for token in piece][: stats.tokens])
        stats.reraise()
        return logits

    def send(self, user_text: str) -> Iterator[str]:
        """Add a user message, yield the answer's text pieces; the turn is closed even if the caller stops."""
        stats = self._new_turn(user_text)
        self.stop_requested = False
        started = time.perf_counter()
        logits = self._read_message(user_text)
        stats.prefill_seconds = time.perf_counter() - started
        answer = Turn("assistant", "", self.cache.tokens_seen)
        self.turns.append(answer)
        streamer = TextStreamer(self.tokenizer)
        sampling = self.sampling
        if sampling.seed is not None:  # a different but reproducible stream per turn
            sampling = replace(sampling, seed=sampling.seed + len(self.turns))
        started = time.perf_counter()
        stats.stopped = "stop"
        try:
            for token in generate_ids(
                self.model, self.cache, logits, sampling, self._stops, self._decode_step()
            ):
                self.ids.append(token)
                stats.generated_tokens += 1
                piece = streamer.push(token)
                answer.content = streamer.printed
                if piece:
                    yield piece
                if self.stop_requested:
                    stats.stopped = "interrupted"
                    break
            else:
                if stats.generated_tokens >= sampling.max_new_tokens:
                    stats.stopped = "length"
        finally:
            stats.decode_seconds = time.perf_counter() - started
            answer.content = streamer.printed
            if self._suffix:
                self._feed(*self._suffix_piece())
            answer.end = self.cache.tokens_seen
            self.stop_requested = False

    def _new_turn(self, user_text: str) -> AnswerStats:
        """The new turn's stats (`last`), once the message is known not to be empty (else an InputError)."""
        if not user_text.strip():
            raise InputError("empty message; type some text")
        self.last = AnswerStats()
        return self.last

    def _read_message(self, user_text: str) -> torch.Tensor | None:
        """Feed a user message, framed by the chat template up to the assistant header, and record its turn;
        returns the logits after the header. The message's last paragraph and the header are read as its
        question (`chat.framing.turn_parts`): a `recall` cache chooses what to bring back with their queries,
        as for `h2o stream --prompt`."""
        parts = [part for part in turn_parts(self.tokenizer, self.system, self.history, user_text) if part]
        bos = not self.turns and not getattr(self.tokenizer, "chat_template", None)  # plain text: its own BOS
        at = "".join(parts).rfind(user_text)  # the message's span in the turn's text
        pieces, frame, offset = [], [], 0
        for n, part in enumerate(parts):
            ids, flags = frame_flags(self.tokenizer, part, (at - offset, at - offset + len(user_text)))
            if bos and not n:
                ids = self.tokenizer(part, add_special_tokens=True)["input_ids"]
                flags = [False] * (len(ids) - len(flags)) + flags
            pieces.append(ids)
            frame.extend(flags)
            offset += len(part)
        pieces[-1] = NewChunk(pieces[-1])
        user_turn = Turn("user", user_text, self.cache.tokens_seen)
        self.turns.append(user_turn)
        logits = self._feed(pieces, frame)
        user_turn.end = self.cache.tokens_seen
        self.last.prompt_tokens = sum(map(len, pieces))
        return logits

    def read_exchange(self, user_text: str, answer: str) -> None:
        """Add a user message and its answer as given, not generated: the message is read as `send` reads
        it, the answer and the end-of-turn text as text. The cache then holds what it would hold had the
        model answered `answer` (up to how the answer's text tokenizes)."""
        self._new_turn(user_text)
        self._read_message(user_text)
        start = self.cache.tokens_seen
        ids, flags = frame_flags(self.tokenizer, answer + self._suffix, (0, len(answer)))
        self._feed([ids], flags)
        self.turns.append(Turn("assistant", answer, start, self.cache.tokens_seen))

    def resume(self, turns: list[dict]) -> int:
        """Read a saved conversation (the `turns` of `save`'s JSON: user and assistant messages in turn)
        with `read_exchange`; returns the messages read. A last user message without an answer is left out
        (the caller can send it again). Raises InputError when the turns do not alternate user, assistant."""
        for number, turn in enumerate(turns):
            role, named = (("user", "a user"), ("assistant", "an assistant"))[number % 2]
            if (
                not isinstance(turn, dict)
                or turn.get("role") != role
                or not isinstance(turn.get("content"), str)
            ):
                raise InputError(
                    f"turn {number + 1} of the transcript is not {named} message with a 'content' text; "
                    "resume a transcript written by h2o chat (/save FILE.json)"
                )
        for user, answer in zip(turns[0::2], turns[1::2], strict=False):
            self.read_exchange(user["content"], answer["content"])
        return len(turns) // 2 * 2

    def frame_pins(self, resident: int) -> list[int]:
        """The template tokens `keep_frame` pins in a cache of `resident` slots per head: the first turn's
        header (its leading run of template tokens: the system message, the user header), then the newest of
        the others, `resident // FRAME_SHARE` in all at most."""
        room = resident // FRAME_SHARE
        head = 0
        while head < len(self.frame) and self.frame[head] == head:
            head += 1
        head = min(head, room)
        newest = list(self.frame[max(head, len(self.frame) - (room - head)) :])
        return list(self.frame[:head]) + newest

    def _pin_frame(self, cache: H2OCache) -> None:
        """Pin `frame_pins` in `cache`, releasing the template tokens that fell out of them."""
        wanted = set(self.frame_pins(cache.report().resident_slots))
        cache.unpin(set(self.frame) - wanted)
        cache.pin(wanted)

    def _suffix_piece(self) -> tuple[list[list[int]], list[bool]]:
        """The end-of-turn text as `_feed`'s (pieces, frame): every token of it is the template's."""
        ids, flags = frame_flags(self.tokenizer, self._suffix, None)
        return [ids], flags

    def _decode_step(self):
        """With `compiled`, the captured one-token forward over the current cache (made once per cache)."""
        if not self.compiled:
            return None
        if self._step is None or self._step.cache is not self.cache:
            from h2o_cli.compiled import CompiledStep

            self._step = CompiledStep(self.model, self.cache)
        return self._step

    def ask(self, user_text: str) -> str:
        """The whole answer to one message."""
        return "".join(self.send(user_text))

    def reset(self) -> None:
        """Forget the conversation: empty cache and transcript."""
        self.cache.close()  # a recall archive's file goes now, not when the old cache is collected
        self.cache = H2OCache(self.model, self.settings)
        self.ids = array("l")
        self.frame = array("l")
        self.turns = []

    def rebuild(self, settings: CacheSettings) -> None:
        """Switch cache settings (budget, policy): a new cache re-reads every token of the conversation.

        The re-read costs one prefill of the whole transcript; token indices stay the same. The new cache is
        built aside and swapped in only when the whole conversation fits it: if the re-read fails (e.g.
        `full` on a conversation longer than the context window) or is interrupted, the error is raised and
        the session goes on unchanged.
        """
        cache = H2OCache(self.model, settings)
        if self.keep_frame and self.frame:
            self._pin_frame(cache)
        if self.ids:
            _, stats = prefill(self.model, cache, [list(self.ids)], FEED_CALL_TOKENS)
            stats.reraise()
        self.cache.close()
        self.settings, self.cache = settings, cache

    def set_budget(self, budget: int) -> None:
        self.rebuild(replace(self.settings, budget=budget))

    def set_policy(self, policy: str, chunk: int | None = None) -> None:
        """Switch to `policy` (and to `chunk` spare slots, when given) by `rebuild`."""
        self.rebuild(replace(self.settings, policy=policy, chunk=chunk or self.settings.chunk))

    def decode_token(self, token_index: int) -> str:
        return self.tokenizer.decode([self.ids[token_index]]) if 0 <= token_index < len(self.ids) else ""

    def turn_at(self, token_index: int) -> int:
        """Index in `turns` of the turn holding a token index (-1 if none)."""
        for number in range(len(self.turns) - 1, -1, -1):
            if self.turns[number].start <= token_index:
                return number
        return -1

    def stats(self) -> dict:
        """Cache and speed figures of the conversation so far."""
        from h2o_cli.runtime import cache_summary, peak_rss_bytes

        summary = cache_summary(self.cache)
        return {
            **summary,
            "tokens_seen": self.cache.tokens_seen,
            "turns": len(self.turns),
            "full_kv_bytes": self.cache.report().full_kv_bytes,
            "last_prompt_tokens": self.last.prompt_tokens,
            "last_generated_tokens": self.last.generated_tokens,
            "last_tokens_per_s": self.last.tokens_per_s,
            "last_prefill_tokens_per_s": (
                self.last.prompt_tokens / self.last.prefill_seconds if self.last.prefill_seconds > 0 else 0.0
            ),
            "last_stopped": self.last.stopped,
            "pinned_slots": self.cache.report().pinned_slots,
            "peak_rss_bytes": peak_rss_bytes(),
        }

    def transcript(self) -> list[dict]:
        return [asdict(turn) for turn in self.turns]

    def save(self, path: str | Path) -> Path:
        """Write the transcript: JSON for a .json path, Markdown otherwise; mode 0600 (it is private text)."""
        path = Path(path).expanduser()
        if path.suffix.lower() == ".json":
            data = {"system": self.system, "settings": asdict(self.settings), "turns": self.transcript()}
            return write_private(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        return write_private(path, to_markdown(self.system, self.turns))

    def save_read(self, path: str | Path, model_name: str) -> int:
        """Write the conversation's cache, token ids and transcript as a saved read (h2o_cli.saved), to go on
        with later without reading it again (`load_read`); returns the bytes written."""
        from h2o_cli.saved import model_identity, write_saved

        extra = {"kind": CHAT, "system": self.system, "turns": self.transcript(), "ids": list(self.ids),
                 "frame": list(self.frame)}  # fmt: skip
        if self.resumed_from is not None:
            self.resumed_from.verified()  # nothing is saved from a damaged save
        return write_saved(path, self.cache, model_identity(self.model, model_name), extra)

    def load_read(self, saved, model_name: str) -> None:
        """Go on from a saved chat (`h2o_cli.saved.SavedRead` of `save_read`, whose settings this session was
        built with: `saved.resume_settings`): the cache, the token ids and the transcript are put back, so the
        next answer is the one the saving session would have given. H2OError in one line for a save of
        another model or of a text."""
        from h2o_cli.saved import model_identity
        from h2o_cli.saved_checks import check_model

        if saved.extra.get("kind") != CHAT:
            raise InputError(f"{saved.path} is a read text, not a chat; ask it with h2o stream --resume")
        check_model(saved, model_identity(self.model, model_name))
        if saved.archive_reach is not None:  # the archive of the save's shape, whatever the disk holds now
            self.cache.close()
            self.cache, self._step = (
                H2OCache(self.model, self.settings, archive_reach=saved.archive_reach),
                None,
            )
        saved.load_into(self.cache)
        self.resumed_from = saved
        self.ids = array("l", saved.extra["ids"])
        self.turns = [Turn(**turn) for turn in saved.extra["turns"]]
        self.frame = array("l", saved.extra.get("frame", ()))
        if self.keep_frame:  # pinned as this session pins them (the save's own pins came back with the cache)
            self._pin_frame(self.cache)


def read_transcript(path: str | Path) -> tuple[str | None, list[dict]]:
    """(system message, turns) of a JSON transcript written by `ChatSession.save`. Raises InputError naming
    what is wrong: a missing or unreadable file, not JSON, or no list of turns."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or "not UTF-8 text"
        raise InputError(f"cannot read the transcript {path}: {reason}") from None
    except json.JSONDecodeError as error:
        raise InputError(
            f"{path} is not JSON (line {error.lineno}); resume a transcript saved as .json by h2o chat"
        ) from None
    turns = data.get("turns") if isinstance(data, dict) else None
    system = data.get("system") if isinstance(data, dict) else None
    if not isinstance(turns, list) or not (system is None or isinstance(system, str)):
        raise InputError(f"{path} holds no chat transcript (a 'turns' list); save one with /save FILE.json")
    return system, turns


def to_markdown(system: str | None, turns: list[Turn]) -> str:
    parts = ["# h2o chat\n"]
    if system:
        parts.append(f"**system:** {system}\n")
    for turn in turns:
        parts.append(f"## {turn.role} (tokens {turn.start}–{turn.end})\n\n{turn.content.strip()}\n")
    return "\n".join(parts)
