"""The `recall` policy's layer (`RecallLayer`, docs/spec.md): `H2OLayer` plus an archive of every token and
recall slots R refilled from it at every step. The path bodies (h2o_cli.cache.paths) are `H2OLayer`'s: this
layer supplies R through their hooks, each doing pass 1 (which archived tokens R holds) for its path."""

from __future__ import annotations

import enum
import functools

import torch

from h2o_cli.cache.layer import H2OLayer
from h2o_cli.cache.paths import Call
from h2o_cli.cache.paths.base import Recalled
from h2o_cli.cache.positions import rolling_positions, rotate, unrotate
from h2o_cli.cache.recall.archive import PageArchive, PageSettings
from h2o_cli.cache.recall.c_step import RecallCStep
from h2o_cli.cache.recall.lead import LeadRanking
from h2o_cli.cache.recall.placement import RecallPlacement
from h2o_cli.cache.recall.scores import choosing_tokens
from h2o_cli.cache.recall.step import RecallCounts, recall_is_full, rolling_step_positions
from h2o_cli.cache.report import LayerSlots
from h2o_cli.errors import UsageError


class LeadMode(enum.Enum):
    """Whose pages a recall layer takes (`--recall-lead`, docs/spec.md: recall, lead head)."""

    OWN = "own"  # its own choice: no lead, or text read without `--lead-text`
    PAGES = "pages"  # from a question to the next chunk of text: the lead's best `lead_pages` pages
    FILL = "fill"  # from a chunk of text (`--lead-text`) to the next: the lead's pages until R is full


class RecallLayer(RecallPlacement, H2OLayer):
    """A layer of the `recall` policy (docs/spec.md): `H2OLayer`'s store holds S, managed as `h2o`; every
    token is also written to a `PageArchive`, and each step refills `recall_slots` slots per KV head from it.

    Pass 1 (which archived tokens R holds) is this layer's: with the chunk's queries (`recall_chunk`), one
    query on the torch step (`step_entries`, `PageArchive.choose_one`), as C calls on the C step (`c_recall`,
    h2o_kernels/archive.c), in fixed shapes (`fixed_entries`), or from the lead head's ranking. Pass 2 is the
    paths' own body over S ∪ R with the exact softmax, scoring S only.
    """

    fused_kernels = False  # the Triton kernels know nothing of the recall slots
    lead: LeadRanking | None = None  # `--recall-lead`: the ranking every head recalls from after a question
    lead_mode = LeadMode.OWN

    def add_archive(
        self,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        bits: int | None = None,
        region=None,
    ) -> None:
        """Allocate the archive (`capacity` tokens; `bits` and `region` as `PageArchive`) and the recall slots
        `[n_kv_heads, recall_slots, head_dim]` (in `dtype`, the compute dtype)."""
        store, policy = self.store, self.policy
        pages = PageSettings.of(policy)
        self.archive = PageArchive(
            store.n_kv_heads, store.head_dim, capacity, pages, dtype, device, bits, region
        )
        shape = (store.n_kv_heads, policy.recall_slots)
        self.recall_keys = torch.zeros(*shape, store.head_dim, dtype=dtype, device=device)
        self.recall_values = torch.zeros(*shape, store.head_dim, dtype=dtype, device=device)
        self.recall_index = torch.full(shape, -1, dtype=torch.int64, device=device)  # token index, -1 = empty
        self.counts = RecallCounts(store.n_kv_heads)

    @property
    def recalled(self) -> float:
        """Tokens recalled per KV head in the last step (the mean over heads)."""
        return self.counts.recalled

    @property
    def hits(self) -> float:
        """Of them, already in the recall slots the step before (not read again)."""
        return self.counts.hits

    @property
    def recalled_total(self) -> float:
        """`recalled` summed over every step since the start."""
        return self.counts.recalled_total

    @property
    def hits_total(self) -> float:
        return self.counts.hits_total

    @property
    def steps(self) -> int:
        return self.counts.steps

    def choice_bytes(self) -> int:
        """Bytes in RAM the page choice keeps beside the archive and the recall slots (the carried scores, the
        section summaries, the shortlist's held keys, the C step's scratch)."""
        built = self.__dict__.get("_c_buffers")  # the C step's buffers, once a step has made them
        return self.archive.choice_bytes() + (built.nbytes() if built is not None else 0)

    def ask(self, tokens: int) -> None:
        self.asks = tokens

    def follow(self, lead: LeadRanking | None) -> None:
        self.lead, self.lead_mode = lead, LeadMode.OWN

    def rewind(self, tokens: int) -> None:
        self.archive.rewind(tokens)
        self.recall_index.fill_(-1)

    def report(self, recall_slots: int | None = None) -> LayerSlots:
        return self._slots(self.recall_index)

    def archive_call(self, call: Call) -> None:
        """Archive the call's unrotated K/V (write-through, before any eviction): in fixed shapes on the fixed
        step, by one C call where the C step can run the layer (a step's token, or a chunk's tokens one after
        the other), else `PageArchive.write`."""
        if call.path.fixed:
            self.archive.write_fixed(call.keys, call.values, call.token)
        elif self._c_buffers is not None:
            self._c_buffers.archive_tokens(call.keys, call.values)
        else:
            self.archive.write(call.keys, call.values)

    def step_key(self, key_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Unrotated elementwise, as the chunk path does, so the archive, its page summaries and hence the page
        choice are bit for bit the chunk path's."""
        return unrotate(key_states[0], cos, sin)

    def recall_chunk(self, query: torch.Tensor, chunk: int) -> Recalled:
        """Pass 1 of the chunk just written (query [n_heads, chunk, head_dim], unrotated): a question ending
        the chunk (`asks`) chooses with its own queries alone; a chunk of text with at most `choice_tokens` of
        its tokens' (evenly spaced, its last among them); a question scores every archived page. Under a lead,
        the lead's pages instead (this layer scores none unless it is the lead's): `LeadRanking.choose` and
        `_read_back`, or in one C call (`RecallCStep.lead_choose`) where the C step can run this layer."""
        store, archive, lead = self.store, self.archive, self.lead
        n_kv, first = store.n_kv_heads, store.tokens_seen - chunk
        slots, hits = self.recall_index.shape[1], 0
        if lead is not None and (self.asks > 1 or chunk > 1):  # a question starts an answer, text ends it
            self.lead_mode = LeadMode.PAGES if self.asks > 1 else LeadMode.OWN
        answering = self.lead_mode is not LeadMode.OWN
        # With `--lead-text` a chunk of text takes the lead's pages too (until R is full), in the other layers.
        text = lead is not None and self.policy.lead_text and chunk > 1 and not answering
        resident = store.token_index[:, : store.active]
        if text:  # the steps that continue the text take the lead's pages, as an answer's do, until R is full
            self.lead_mode = LeadMode.FILL
        if slots and (answering or text) and lead.archive is not archive:
            buffers = self._c_buffers
            # In C where it can run: the same tokens (the chunk's own are all in S, so none is a candidate).
            if buffers is not None:
                ranked = lead.ranked()
                hits = buffers.lead_choose(ranked, lead.taken(ranked, text))[1]
            else:
                chosen, valid = lead.choose(archive, resident, first, slots, fill=text)
                hits = self._read_back(chosen, valid)
        elif slots:
            weighed, picks, asked = choosing_tokens(chunk, self.asks, self.policy.choice_tokens, query.device)
            grouped = self._page_query(query.index_select(1, picks), chunk).reshape(
                n_kv, -1, store.head_dim
            )  # [n_kv, group * picked, d]
            chosen, valid = archive.choose(grouped, resident, first, slots, weighed, question=asked)
            if answering:  # the lead layer: its carried scores rank for the others, and every head of it
                lead.asked(archive.span // archive.page_size)  # takes the lead's pages
                chosen, valid = lead.choose(archive, resident, first, slots)
            elif text:
                lead.ready = True
            hits = self._read_back(chosen, valid)
        self.counts.add((self.recall_index >= 0).sum(), hits)
        return Recalled(self.recall_keys, self.recall_values, self.recall_index >= 0)

    def step_entries(self, query: torch.Tensor, call: Call) -> tuple[torch.Tensor, int, Recalled]:
        """Pass 1 of a torch step (after its write; S packed): `PageArchive.choose_one`, or the lead's pages
        while answering; then the positions of S ∪ R (`rolling_step_positions`, or token indices)."""
        store, archive = self.store, self.archive
        resident = store.token_index[:, : store.active]
        slots = self.recall_index.shape[1]
        answering = self.lead_mode is not LeadMode.OWN
        full = not answering and recall_is_full(archive.held(), store.length, slots)
        if slots and answering:
            self._lead_scores(query, call)
            fill = self.lead_mode is LeadMode.FILL
            chosen, valid = self.lead.choose(archive, resident, store.tokens_seen - 1, slots, fill)
            self.counts.add(valid.sum(), self._read_back(chosen, valid))
        elif slots:
            page_query = self._step_page_query(query, call.cos, call.sin)
            chosen, valid = archive.choose_one(page_query, resident, slots)
            hits = self._read_back(chosen, valid, full)
            self.counts.add(slots * store.n_kv_heads if full else valid.sum(), hits)
        else:
            self.counts.add(0, 0)
        recalled = Recalled(self.recall_keys, self.recall_values, None if full else self.recall_index >= 0)
        if self.positions != "rolling":
            key_positions = torch.cat([resident, self.recall_index.clamp_min(0)], dim=1)
            return key_positions, store.tokens_seen - 1, recalled
        recent_from = self._recent_from(store.tokens_seen - 1) if self._contiguous else None
        key_positions, position = rolling_step_positions(resident, self.recall_index, full, recent_from)
        return key_positions, position, recalled

    def c_recall(self, query: torch.Tensor, call: Call) -> int:
        """Pass 1 of a C step (S full): the page bounds (`StepScores.bounds`: in C when a step scores with
        carried scores, else by torch), then `RecallCStep.choose` (the rest of `choose_one` and the read into
        the recall slots); while answering under a lead, `RecallCStep.lead_choose` from the lead's ranking,
        sorted once for every layer. The same recalled tokens as the torch step. Returns the recall slots of
        the fullest head."""
        buffers, slots = self._c_buffers, self.recall_index.shape[1]
        if not slots:
            self.counts.add(0, 0)
            return 0
        if self.lead_mode is not LeadMode.OWN:
            self._lead_scores(query, call, buffers.scores)
            ranked = self.lead.ranked()
            pages = self.lead.taken(ranked, self.lead_mode is LeadMode.FILL)
            recalled, hits = buffers.lead_choose(ranked, pages)
        else:
            bounds = buffers.scores.bounds(self._step_page_query(query, call.cos, call.sin))
            recalled, hits = buffers.choose(bounds)
        self.counts.add(recalled, hits)
        return buffers.most

    def fixed_entries(
        self, query: torch.Tensor, call: Call, length: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Recalled]:
        """Pass 1 of a fixed step (after its write): `PageArchive.choose_fixed` and `_read_back`, from tensors
        only; then the positions over every slot of S and R, rolling ones ranked on the device."""
        store = self.store
        if self.recall_index.shape[1]:
            page_query = unrotate(query[0, :, 0], call.cos.to(query.dtype), call.sin.to(query.dtype)).float()
            if self._fixed_mean is not None:
                page_query = rotate(page_query, *self._fixed_mean)
            chosen, valid = self.archive.choose_fixed(
                page_query.view(store.n_kv_heads, -1, store.head_dim),
                store.token_index,
                self.recall_index.shape[1],
            )
            self.counts.add_fixed(valid.sum(), self._read_back(chosen, valid))
        recalled = self.recall_index >= 0
        tokens = torch.cat([store.token_index, self.recall_index], dim=1)
        if self.positions == "rolling":
            present = torch.cat([store.valid, recalled], dim=1)
            key_positions, entries = rolling_positions(
                self._placed(tokens, call.token), present, read_back=False
            )
            position = (entries - 1).view(1)
        else:
            key_positions, position = tokens.clamp_min(0), call.token
        return key_positions, position, Recalled(self.recall_keys, self.recall_values, recalled)

    def prepare_fixed(self) -> None:
        """As `H2OLayer.prepare_fixed`, with the page score's mean rotation taken once and the statistics kept
        on the device. A file archive, original positions with `--page-score positional` (whose distances grow
        with the tokens seen), or a lead head cannot take the fixed step: `UsageError`."""
        super().prepare_fixed()
        policy, archive, device = self.policy, self.archive, self.store.keys.device
        if self.lead is not None:
            raise UsageError(
                f"the fixed decode step (--compile) does not take a lead head yet: --recall-lead "
                f"{self.policy.recall_lead} needs none (or auto, which leaves it out)"
            )
        if archive.region is not None:
            raise UsageError(
                "the fixed decode step (--compile) needs the recall archive in RAM: --archive ram"
            )
        rolling = self.positions == "rolling"
        distances = policy.score_distances(rolling, 1, archive.tokens)
        if distances is not None and not rolling:
            raise UsageError(
                "the fixed decode step (--compile) with original positions needs --page-score unrotated "
                "(the positional score's distances grow with every token)"
            )
        self._fixed_mean = None
        if distances is not None:
            self._fixed_mean = tuple(part.clone() for part in self.rope.mean_rotation(*distances, device))
        self.counts.fix(device)

    def stepped_fixed(self) -> None:
        super().stepped_fixed()
        self.archive.stepped_fixed()
        self.counts.stepped_fixed()

    def fixed_buffers(self) -> list[torch.Tensor]:
        archive = self.archive
        tensors = [self.recall_keys, self.recall_values, self.recall_index, self.counts._fixed]
        return super().fixed_buffers() + tensors + [archive.token_index, archive.summary, *archive._stored()]

    @functools.cached_property
    def _c_buffers(self) -> RecallCStep | None:
        """The C calls' fixed arguments when they can run this layer (h2o_cli.cache.recall.c_step): as
        `H2OLayer._c_buffers`, and a float32 archive (in RAM or a file); else None (the torch step)."""
        archive = self.archive
        if self._c_possible() and archive.keys.dtype == archive.dtype == torch.float32:
            return RecallCStep(self)
        return None

    def _lead_scores(self, query: torch.Tensor, call: Call, scores=None) -> None:
        """An answer step of the lead layer: carry its page scores on (`PageArchive.step_bounds`, or the C
        step's `StepScores.bounds`) for the ranking every layer reads; any other layer scores nothing."""
        if self.lead.archive is self.archive:
            page_query = self._step_page_query(query, call.cos, call.sin)
            (scores.bounds if scores is not None else self.archive.step_bounds)(page_query)
            self.lead.ready = True

    def _step_page_query(self, query: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A one-token step's page-scoring queries [n_kv, group, head_dim]: the model's rotated query unrotated
        elementwise, as the chunk path has it, so the page bounds are bit for bit the chunk path's."""
        unrotated = unrotate(query[0, :, 0], cos.to(query.dtype), sin.to(query.dtype))
        return self._page_query(unrotated, 1).view(self.store.n_kv_heads, -1, self.store.head_dim)

    def _page_query(self, query: torch.Tensor, chunk: int) -> torch.Tensor:
        """The queries (unrotated, any shape [..., head_dim]) that score archive pages, in float32: as they are
        (`--page-score unrotated`) or rotated by the mean rotation over the distances the policy gives for a
        chunk of `chunk` tokens (`positional`; docs/spec.md, recall), the chunk already archived. Elementwise,
        so a one-token step scores bit for bit as a chunk of one."""
        query = query.float()
        distances = self.policy.score_distances(self.positions == "rolling", chunk, self.archive.tokens)
        if distances is None:
            return query
        return rotate(query, *self.rope.mean_rotation(*distances, query.device))

    def _read_back(self, chosen: torch.Tensor, valid: torch.Tensor, full: bool = False) -> torch.Tensor:
        """Fill the recall slots with archive slots `chosen` [n_kv, r] where `valid` (all of them when `full`),
        in that order (empty: 0). Returns the hits summed over KV heads (a 0-d tensor): chosen tokens the
        slots held already.

        A RAM archive reads every chosen token in one row select; a file archive moves the hits inside the
        slots and reads only the others (the pages new to the slots). Either way the slots end up the same."""
        archive = self.archive
        wanted = archive.token_index.take(chosen)  # [n_kv, r] token indices
        if not full:
            wanted.masked_fill_(~valid, -1)
        # The slots hold these tokens in this order (as a lead's answer steps often do): all hits, nothing to
        # read. Not on the fixed step, which takes no branch on the data (a captured graph).
        if not self.fixed and torch.equal(wanted, self.recall_index):
            return torch.tensor(wanted.numel()) if full else valid.sum()
        held, order = self.recall_index.sort(dim=1)
        place = torch.searchsorted(held, wanted).clamp_max_(held.shape[1] - 1)
        hit = held.gather(1, place) == wanted
        if not full:
            hit &= valid
        if archive.region is None:
            archive.read_into(chosen, self.recall_keys, self.recall_values)
        else:  # R as [n_kv * r, head_dim] rows: the hits moved, the others read (row selects, not gathers)
            n_kv, r, head_dim = self.recall_keys.shape
            rows = order.gather(1, place).add_(torch.arange(0, n_kv * r, r, device=order.device)[:, None])
            missing = (valid & ~hit).view(-1).nonzero().squeeze(1)  # R's rows to read from the archive
            read = archive.read(missing // r, chosen.reshape(-1)[missing])
            for slots, new in zip((self.recall_keys, self.recall_values), read, strict=True):
                flat = slots.view(-1, head_dim)
                flat.copy_(flat.index_select(0, rows.view(-1)).index_copy_(0, missing, new))
        if not full:
            empty = ~valid.unsqueeze(-1)
            self.recall_keys.masked_fill_(empty, 0)
            self.recall_values.masked_fill_(empty, 0)
        self.recall_index.copy_(wanted)
        return hit.sum()

    def reset(self) -> None:
        super().reset()
        self.lead_mode = LeadMode.OWN
        self.archive.reset()
        self.recall_index.fill_(-1)
        self.recall_keys.zero_()  # empty slots hold 0 (`_read_back`)
        self.recall_values.zero_()
        self.counts.reset()
