"""The `recall` policy's layer (`RecallLayer`, docs/spec.md): `H2OLayer` plus an archive of every token and
recall slots refilled from it at every step."""

from __future__ import annotations

import functools

import torch
from h2o_kernels import slot_attention
from h2o_kernels.dispatch import use_native

from h2o_cli.cache.fixed_step import accumulate_fixed, evict_fixed, fixed_query
from h2o_cli.cache.layer import STEPS, Call, CallPath, H2OLayer, query_weights
from h2o_cli.cache.positions import placed_order, rolling_positions, rotate, unrotate
from h2o_cli.cache.recall.archive import PageArchive, PageSettings
from h2o_cli.cache.recall.c_step import RecallCStep
from h2o_cli.cache.recall.lead import LeadRanking
from h2o_cli.cache.recall.step import RecallCounts, recall_is_full, rolling_step_positions
from h2o_cli.cache.step import step_attention
from h2o_cli.errors import UsageError


def choosing_tokens(
    chunk: int, asks: int, limit: int, device: torch.device
) -> tuple[int, torch.Tensor, bool]:
    """Which of a chunk's `chunk` tokens choose what it recalls, and how many tokens their choice weighs: a
    question of `asks` >= 2 tokens ending the chunk (`H2OCache.asking`), all of its tokens, weighing `asks`;
    else at most `limit` (0: every one) of the chunk's tokens, evenly spaced and its last among them (every
    ceil(chunk / limit)-th, counted back from the last), weighing `chunk`. Returns (weight, the tokens' offsets
    in the chunk [picked], ascending, whether they are a question's)."""
    if 1 < asks <= chunk:
        return asks, torch.arange(chunk - asks, chunk, device=device), True
    if not limit or chunk <= limit:
        return chunk, torch.arange(chunk, device=device), False
    return chunk, torch.arange(chunk - 1, -1, -chunk // limit, device=device).flip(0), False


class RecallLayer(H2OLayer):
    """A layer of the `recall` policy (docs/spec.md): `H2OLayer`'s store holds S, managed as `h2o`; every
    token is also written to a `PageArchive`, and each step refills `recall_slots` slots per KV head from it.

    The step runs on the torch reference (also on CUDA): pass 1 chooses the recalled tokens with the chunk's
    queries, pass 2 attends over S, them and the chunk with the exact softmax, scores S only, evicts. A
    one-token call takes the same steps in far fewer ops (`_torch_step`, h2o_cli.cache.recall.step), or as
    C calls on the CPU once S is full (`_c_step`, h2o_kernels/archive.c and step.c).
    """

    # The new keys are unrotated elementwise, as the chunk path does, so the archive, its page summaries and
    # hence the page choice are bit for bit the chunk path's.
    step_keys_by_map = False
    fused_kernels = False  # the Triton kernels know nothing of the recall slots
    lead: LeadRanking | None = None  # `--recall-lead`: the ranking every head recalls from after a question
    # With a lead: from a question to the next chunk of text (its pages are recalled); with `--lead-text` also
    # from a chunk of text to the next chunk (the steps that continue it), then `filling`: as many of the lead's
    # pages as fill R.
    answering = filling = False

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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs=None, **extra):
        """As `H2OLayer.update`, and archive the call's unrotated K/V (write-through, before any eviction)."""
        result = super().update(key_states, value_states, *args, kwargs=kwargs, **extra)
        call = self._call
        if call.path is CallPath.FIXED_STEP:
            self.archive.write_fixed(call.keys, call.values, call.token)
        elif call.path in STEPS and self._c_buffers is not None:
            self._c_buffers.archive_token(call.keys, call.values)  # one C call for the same writes
        else:
            self.archive.write(call.keys, call.values)
        return result

    def _chunk_attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The recall step for the chunk just written (query [n_heads, chunk, head_dim], unrotated).
        Returns [1, chunk, n_heads, head_dim]."""
        chunk, store, decay = query.shape[1], self.store, self.policy.decay_per_query
        n_kv, active, first = store.n_kv_heads, store.active, store.tokens_seen - chunk
        slots, hits = self.recall_index.shape[1], 0
        if self.lead is not None and (self.asks > 1 or chunk > 1):  # a question starts an answer,
            self.answering, self.filling = self.asks > 1, False  # and a chunk of text ends it
        # With `--lead-text` a chunk of text takes the lead's pages too (until R is full), in the other layers.
        text = self.lead is not None and self.policy.lead_text and chunk > 1 and not self.answering
        leading = (self.answering or text) and self.lead.archive is not self.archive
        if slots and leading:  # the lead's pages (docs/spec.md, recall: lead head); this layer scores none
            resident = store.token_index[:, :active]
            chosen, valid = self.lead.choose(self.archive, resident, first, slots, fill=text)
            hits = self._read_back(chosen, valid)
        elif slots:  # pass 1: the chunk's queries choose archived tokens, read back into the recall slots
            # A question ending the chunk (H2OCache.asking) chooses with its own queries alone; a chunk of
            # text with at most `choice_tokens` of its tokens' (evenly spaced, its last among them). A question
            # scores every archived page.
            weighed, picks, asked = choosing_tokens(chunk, self.asks, self.policy.choice_tokens, query.device)
            grouped = self._page_query(query.index_select(1, picks), chunk).reshape(
                n_kv, -1, store.head_dim
            )  # [n_kv, group * picked, d]
            chosen, valid = self.archive.choose(
                grouped, store.token_index[:, :active], first, slots, weighed, question=asked
            )
            if self.answering or text:  # the lead layer: its carried scores rank for the others
                self.lead.ready = True
            if self.answering:  # and every head of it takes the lead's pages
                chosen, valid = self.lead.choose(self.archive, store.token_index[:, :active], first, slots)
            hits = self._read_back(chosen, valid)
        if text:  # the steps that continue the text take the lead's pages, as an answer's do, until R is full
            self.answering = self.filling = True
        self.counts.add((self.recall_index >= 0).sum(), hits)
        # Pass 2: E_q = S ∪ R ∪ {chunk tokens <= q}; R is older than the chunk, so every query sees all of it.
        token_index = torch.cat([store.token_index[:, :active], self.recall_index], dim=1)
        present = token_index >= 0
        allowed = torch.cat(
            [
                store.allowed(chunk).expand(-1, chunk, -1),
                present[:, active:].unsqueeze(1).expand(-1, chunk, -1),
            ],
            dim=2,
        )
        if self.positions == "rolling":  # ranks of E_q by token index, every head's queries at one position
            key_positions, entries = rolling_positions(self._placed(token_index, first), present)
            first_query_position = entries - chunk
        else:
            key_positions = token_index.clamp_min(0)
            first_query_position = first
        cos_table, sin_table = self.rope.table(first_query_position + chunk, query.dtype, query.device)
        query_positions = slice(first_query_position, first_query_position + chunk)
        output, increments, last_probs = slot_attention(
            query,
            torch.cat([store.key_states(active), self.recall_keys.to(store.compute_dtype)], dim=1),
            torch.cat([store.value_states(active), self.recall_values.to(store.compute_dtype)], dim=1),
            allowed,
            cos_table[query_positions],
            sin_table[query_positions],
            cos_table[key_positions],
            sin_table[key_positions],
            scaling,
            query_weights(decay, chunk, query.device),
        )
        # S only (r = 0 is h2o), decayed as h2o's: R's entries are not S's, so nothing decays them.
        store.accumulate(increments[:, :active], last_probs[:, :active], chunk, decay=decay)
        store.evict(self.policy)
        return output.transpose(0, 1).unsqueeze(0)

    def _torch_step(self, call: Call, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The recall step of one token (decode) on the torch path (`attend` packed S into its lowest slots):
        pass 1 by `PageArchive.choose_one`, pass 2 by one softmax over S and R (`step_attention` with R) at
        the positions of `rolling_step_positions` or token indices, S's scores, eviction. The chunk path's
        result (docs/spec.md; h2o_cli.cache.recall.step says why each part is the same).
        query: [1, n_heads, 1, head_dim] rotated by the model. Returns [1, 1, n_heads, head_dim]."""
        store, archive = self.store, self.archive
        store.write(call.keys, call.values)
        active, n_kv, head_dim = store.active, store.n_kv_heads, store.head_dim  # active == length: packed
        resident = store.token_index[:, :active]
        slots = self.recall_index.shape[1]
        full = not self.answering and recall_is_full(archive.held(), store.length, slots)
        if slots and self.answering:
            self._lead_scores(query, call)
            chosen, valid = self.lead.choose(archive, resident, store.tokens_seen - 1, slots, self.filling)
            self.counts.add(valid.sum(), self._read_back(chosen, valid))
        elif slots:
            page_query = self._step_page_query(query, call.cos, call.sin)
            chosen, valid = archive.choose_one(page_query, resident, slots)
            hits = self._read_back(chosen, valid, full)
            self.counts.add(slots * n_kv if full else valid.sum(), hits)
        else:
            self.counts.add(0, 0)
        present = None if full else self.recall_index >= 0
        if self.positions == "rolling":
            recent_from = self._recent_from(store.tokens_seen - 1) if self._contiguous else None
            key_positions, position = rolling_step_positions(resident, self.recall_index, full, recent_from)
        else:
            key_positions = torch.cat([resident, self.recall_index.clamp_min(0)], dim=1)
            position = store.tokens_seen - 1
        query_map, step_table = self._step_maps(call.cos, call.sin, position, scaling, query.device)
        output, probs = step_attention(
            self._grouped(query, query_map),
            store.key_states(active),
            store.value_states(active),
            key_positions,
            step_table,
            (self.recall_keys, self.recall_values, present),
        )
        increments = probs[:, :, :active].sum(dim=1)  # [n_kv, active]: S only (r = 0 is h2o)
        store.accumulate(increments, increments, 1, decay=self.policy.decay_per_query)
        self._evict_after_step()
        return output.to(query.dtype).view(1, 1, -1, head_dim)

    def prepare_fixed(self) -> None:
        """As `H2OLayer.prepare_fixed`, with room for the recall slots' positions, the page score's mean
        rotation taken once, and the statistics kept on the device. A file archive, original positions
        with `--page-score positional` (whose distances grow with the tokens seen), or a lead head cannot
        take the fixed step: `UsageError`."""
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
        if rolling:
            self.fixed_rows = self.store.slots + self.recall_index.shape[1]
        self.counts.fix(device)

    def stepped_fixed(self) -> None:
        super().stepped_fixed()
        self.archive.stepped_fixed()
        self.counts.stepped_fixed()

    def _fixed_step(self, call: Call, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """`_torch_step` in fixed shapes, read from tensors only (h2o_cli.cache.fixed_step): S written into its
        lowest free slot, pass 1 by `PageArchive.choose_fixed` and `_read_back`, one softmax over every slot of
        S (empty ones masked) and R, rolling positions ranked on the device, S's scores, eviction where S passes
        its budget. query: [1, n_heads, 1, head_dim] rotated by the model. Returns [1, 1, n_heads, head_dim]."""
        store, archive = self.store, self.archive
        length = store.write_fixed(call.keys, call.values, call.token)
        slots = self.recall_index.shape[1]
        if slots:
            page_query = unrotate(query[0, :, 0], call.cos.to(query.dtype), call.sin.to(query.dtype)).float()
            if self._fixed_mean is not None:
                page_query = rotate(page_query, *self._fixed_mean)
            chosen, valid = archive.choose_fixed(
                page_query.view(store.n_kv_heads, -1, store.head_dim), store.token_index, slots
            )
            self.counts.add_fixed(valid.sum(), self._read_back(chosen, valid))
        recalled = self.recall_index >= 0
        if self.positions == "rolling":
            tokens = torch.cat([store.token_index, self.recall_index], dim=1)
            present = torch.cat([store.valid, recalled], dim=1)
            key_positions, entries = rolling_positions(
                self._placed(tokens, call.token), present, read_back=False
            )
            position = (entries - 1).view(1)
        else:
            key_positions = torch.cat([store.token_index, self.recall_index], dim=1).clamp_min(0)
            position = call.token
        cos_table, sin_table, step_table = self._fixed_tables()
        grouped = fixed_query(
            query, call.cos, call.sin, cos_table, sin_table, position, scaling, store.n_kv_heads
        )
        dtype = grouped.dtype  # float32 for a 16-bit store: S's slots and R upcast as they are read
        output, probs = step_attention(
            grouped,
            store.key_states(dtype=dtype),
            store.value_states(dtype=dtype),
            key_positions,
            step_table,
            (self.recall_keys.to(dtype), self.recall_values.to(dtype), recalled),
            present=store.valid,
        )
        accumulate_fixed(store, probs[:, :, : store.slots].sum(dim=1), self.policy.decay_per_query)
        evict_fixed(store, self.policy, length + 1)
        return output.to(query.dtype).view(1, 1, -1, store.head_dim)

    @functools.cached_property
    def _c_buffers(self) -> RecallCStep | None:
        """The C calls' fixed arguments when they can run this layer (h2o_cli.cache.recall.c_step): a
        `kernel_victim` policy, float32 store and a float32 archive (in RAM or a file) on the CPU, `--kernels auto` or
        `native` with a C compiler; else None (the torch step)."""
        store, archive = self.store, self.archive
        if (
            self.policy.kernel_victim
            and store.keys.dtype == store.compute_dtype == torch.float32
            and archive.keys.dtype == archive.dtype == torch.float32
            and use_native(store.keys.device, self.settings.kernels)
        ):
            return RecallCStep(self)
        return None

    def _c_step(self, call: Call, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """`_torch_step` as C calls for a full S: the page bounds (`StepScores.bounds`: in C when a step scores
        with carried scores, else by torch), then `RecallCStep.choose` (the rest of `choose_one` and the read
        into the recall slots; while answering under a lead, `RecallCStep.lead_choose` from the lead's
        ranking, sorted once for every layer, instead), the query map for the position that leaves, and `RecallCStep.run` (write,
        attention over S ∪ R, S's scores, eviction). The same recalled tokens as the torch step, the rest to float rounding."""
        store, policy = self.store, self.policy
        buffers = self._c_buffers
        most = 0  # recall slots of the fullest head
        slots = self.recall_index.shape[1]
        if slots and self.answering:  # the lead's pages, from its ranking sorted once for every layer
            self._lead_scores(query, call, buffers.scores)
            ranked = self.lead.ranked()
            recalled, hits = buffers.lead_choose(ranked, len(ranked) if self.filling else self.lead.pages)
            most = buffers.most
            self.counts.add(recalled, hits)
        elif slots:
            bounds = buffers.scores.bounds(self._step_page_query(query, call.cos, call.sin))
            recalled, hits = buffers.choose(bounds)
            most = buffers.most
            self.counts.add(recalled, hits)
        else:
            self.counts.add(0, 0)
        rolling = self.positions == "rolling"
        placement = (2 if self._contiguous else 1) if rolling else 0  # step.c's `rolling`
        # The query's position: its rank in E_q (S after the write, and the fullest head's R), or its index.
        position = store.length + most if rolling else store.tokens_seen
        query_map, step_table = self._step_maps(call.cos, call.sin, position, scaling, query.device)
        output = buffers.run(
            self._grouped(query, query_map),
            call.keys,
            call.values,
            step_table,
            rolling=placement,
            limit=store.length + 1 - policy.recent_slots,
            decay=policy.decay_per_query,
            entries=position + 1,
        )
        return output.to(query.dtype).view(1, 1, -1, store.head_dim)

    def _lead_scores(self, query: torch.Tensor, call: Call, scores=None) -> None:
        """An answer step of the lead layer: carry its page scores on (`PageArchive.step_bounds`, or the C
        step's `StepScores.bounds`) for the ranking every layer reads; any other layer scores nothing."""
        if self.lead.archive is self.archive:
            page_query = self._step_page_query(query, call.cos, call.sin)
            (scores.bounds if scores is not None else self.archive.step_bounds)(page_query)
            self.lead.ready = True

    @property
    def _contiguous(self) -> bool:
        """Whether rolling positions place R as one block before the recent window (`--recall-place`)."""
        return self.policy.recall_place == "contiguous" and self.recall_index.shape[1] > 0

    def _recent_from(self, first: int | torch.Tensor) -> int | torch.Tensor:
        """The oldest token of the block R is placed before, for a call whose first token is `first`: a step's
        recent window (its `recent_slots` newest tokens, at least its own), and for a chunk the same window's
        older tokens and the whole chunk. The C step's split (`limit`, at most |S| - 1) is the same block."""
        return first - max(self.policy.recent_slots, 1) + 1

    def _placed(self, token_index: torch.Tensor, first: int | torch.Tensor) -> torch.Tensor:
        """What `rolling_positions` ranks E_q by for a call whose first token is `first`: the token indices
        [n_kv_heads, |S| + r] (R's `r` columns last), or under `--recall-place contiguous` `placed_order`'s key
        with R before `_recent_from(first)`."""
        if not self._contiguous:
            return token_index
        return placed_order(token_index, self.recall_index.shape[1], self._recent_from(first))

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

    def _step_tables(self, position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """As `H2OLayer._step_tables`, with room for the recall slots' positions."""
        slots = self.recall_index.shape[1]
        return self.rope.table(max(position + 1, self.store.slots) + slots, self.store.compute_dtype, device)

    def _read_back(self, chosen: torch.Tensor, valid: torch.Tensor, full: bool = False) -> torch.Tensor:
        """Fill the recall slots with archive slots `chosen` [n_kv, r] where `valid` (all of them when `full`),
        in that order (empty: 0). Returns the hits summed over KV heads (a 0-d tensor): chosen tokens the
        slots held already.

        A hit's K/V in the slots are the archive's own, so a RAM archive reads every chosen token in one row
        gather; a file archive moves the hits inside the slots and reads only the others, so it reads just
        the pages that are new to the slots. Either way the slots end up the same."""
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
        else:
            source = order.gather(1, place).unsqueeze(-1).expand(-1, -1, self.recall_keys.shape[-1])
            keys, values = self.recall_keys.gather(1, source), self.recall_values.gather(1, source)
            heads, columns = (valid & ~hit).nonzero(as_tuple=True)
            keys[heads, columns], values[heads, columns] = archive.read(heads, chosen[heads, columns])
            self.recall_keys.copy_(keys)
            self.recall_values.copy_(values)
        if not full:
            empty = ~valid.unsqueeze(-1)
            self.recall_keys.masked_fill_(empty, 0)
            self.recall_values.masked_fill_(empty, 0)
        self.recall_index.copy_(wanted)
        return hit.sum()

    def reset(self) -> None:
        super().reset()
        self.answering = self.filling = False
        self.archive.reset()
        self.recall_index.fill_(-1)
        self.recall_keys.zero_()  # empty slots hold 0 (`_read_back`)
        self.recall_values.zero_()
        self.counts.reset()
