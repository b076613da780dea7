"""`--model h2o`: an lm-evaluation-harness model that scores through the H2O cache.

From the command line, through `h2o lm-eval` (lm-eval's own CLI with this module imported first; lm-eval
0.4.13 does not load models from an entry-point group, so plain `lm_eval --model h2o` cannot find it):

    h2o lm-eval --model h2o --model_args model=smollm2-135m,budget=0.2,policy=h2o --tasks h2o_copa

From Python: `import h2o_cli.eval.lm_eval_model`, then `lm_eval.simple_evaluate(model="h2o", ...)`.

lm-eval's own models (`hf`, `vllm`, ...) stay available beside it: lm-eval 0.4.13 lists them lazily in its
registry only when `get_model` finds the registry empty, so this module imports `lm_eval.models` (the list,
not the models) before registering `h2o`.

Requests run one at a time (the cache holds one sequence). Requests sharing a context are scored together
(`CachePool.scores`: a short context is read again with each choice in one forward call, a long one
prefilled once).
Every request's budget (in tokens) is recorded in `budget_tokens` for reporting.

Contexts longer than the model's window: a policy that streams (it evicts, on rolling positions) reads every
context whole, in chunks, as `h2o stream` reads a file; its budget is then a token count (`budget=819`) or a
fraction of the model's window (as `h2o stream`'s), not of the prompt. A policy that cannot stream (`full`,
or one on absolute positions) keeps the last `window - answer` tokens of a context, as lm-eval's own `hf`
model does, and says in one warning line how many contexts it cut. A policy that recalls reads the last line
of a context past the window as its question (`_split_question`), as `h2o stream --prompt` reads one.
"""

from __future__ import annotations

import logging
import os
from itertools import groupby

import lm_eval.models  # noqa: F401 - lm-eval's own models first (see above)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from h2o_cli.config import CacheSettings
from h2o_cli.eval.scoring import CachePool, budget_used, continuation_scores, greedy_answer
from h2o_cli.policies import policy_class

log = logging.getLogger(__name__)


@register_model("h2o")
class H2OLM(TemplateLM):
    """Model args: model, device, device_map, dtype, quant, threads, and every `CacheSettings` field (budget, policy,
    heavy_ratio, sinks, positions, score_norm, chunk, kv_bits). The budget is a fraction of each prompt, or of
    the model's window for a context past it (a policy that streams reads it whole; others keep its end).

    `model` may also be an already loaded `(model, tokenizer)` pair (from Python, not the command line).
    """

    def __init__(
        self,
        model="smollm2-135m",
        device: str = "cpu",
        dtype: str = "auto",
        quant: str = "none",
        threads: int = 0,
        device_map: str | None = None,
        pretrained=None,
        budget: float | str = 0.2,
        **args,
    ) -> None:
        super().__init__()
        if threads:
            torch.set_num_threads(int(threads))
        self._rank, self._world_size = join_processes(device)
        if self._world_size > 1 and str(device).startswith(("cuda", "auto")) and torch.cuda.is_available():
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"  # one GPU per process
        if isinstance(model, tuple):
            self.model, self.tokenizer = model
        else:
            from h2o_cli.models import load_model

            self.model, self.tokenizer = load_model(
                pretrained or model, device=device or "cpu", dtype=dtype, quant=quant, device_map=device_map
            )
        self.configure(CacheSettings.from_args(budget=budget, **args))  # other names (batch_size, ...) unused

    def configure(self, settings: CacheSettings) -> None:
        """Switch cache settings (policy, budget, ...) without reloading the weights."""
        self.settings = settings
        self.pool = CachePool(self.model, settings)
        policy = policy_class(settings.policy)
        self.streams = policy.evicts and policy.positions_for(settings.positions) == "rolling"
        # past the window a fraction is of the window (a count stays a count): `long_pool.cache_for` keeps it
        long = settings.resolved(self.pool.window, floor=True) if self.streams else settings
        self.long_pool = CachePool(self.model, long)
        self.budget_tokens: list[int] = []
        self.contexts_cut = 0  # contexts a policy that cannot stream lost their start to the window

    def _pool_for(self, tokens: int) -> CachePool:
        """The pool for an example of `tokens` tokens: the window's budget past the window, the prompt's inside."""
        return self.long_pool if tokens > self.max_length else self.pool

    def _fit(self, ids: list[int], extra_tokens: int) -> list[int]:
        """`ids` whole for a policy that streams; otherwise their last `window - extra_tokens` (counted)."""
        keep = self.max_length - extra_tokens
        if self.streams or len(ids) <= keep:
            return ids
        self.contexts_cut += 1
        return ids[-keep:]

    def _report_cuts(self) -> None:
        if self.contexts_cut:
            log.warning(
                "policy %s cannot read past the %d-token window: %d context(s) kept only their last tokens "
                "(a policy that evicts on rolling positions, e.g. recall or h2o, reads them whole)",
                self.settings.policy, self.max_length, self.contexts_cut,
            )  # fmt: skip
            self.contexts_cut = 0

    # lm-eval's data parallelism: under `accelerate launch` (or torchrun) each process is given every
    # `world_size`-th document and scores it with its own cache; rank 0 gathers the metrics.
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        import torch.distributed as dist

        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self._world_size == 1:
            return [obj]
        import torch.distributed as dist

        gathered = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def gathered_budget_tokens(self) -> list[int] | None:
        """`budget_tokens` of every process on rank 0 (this process's alone in one), None on the others."""
        parts = self.gather_object(self.budget_tokens)
        return None if parts is None else [tokens for part in parts for tokens in part]

    def barrier(self) -> None:
        if self._world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.pool.window

    @property
    def device(self):
        return self.model.device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "h2o")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"]

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    @staticmethod
    def _bar(items=None, total: int | None = None, disable: bool = False, desc: str = ""):
        """tqdm progress bar, off when asked or when $TQDM_DISABLE is set (`h2o eval` without --verbose)."""
        disable = disable or os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")
        return tqdm(items, total=total, disable=disable, desc=desc)

    def _cache(self, prompt_tokens: int, extra_tokens: int):
        cache = self._pool_for(prompt_tokens + extra_tokens).cache_for(prompt_tokens, extra_tokens)
        self.budget_tokens.append(budget_used(cache, prompt_tokens))
        return cache

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: tuple(requests[i][1]))
        progress = self._bar(total=len(requests), disable=disable_tqdm, desc="h2o loglikelihood")
        for context, group in groupby(order, key=lambda i: tuple(requests[i][1])):
            indices = list(group)
            continuations = [requests[i][2] for i in indices]
            longest = max(len(c) for c in continuations)
            context_ids = self._fit(list(context), longest)
            scores, budget = self._pool_for(len(context_ids) + longest).scores(context_ids, continuations)
            self.budget_tokens.append(budget)
            for index, score in zip(indices, scores, strict=False):
                results[index] = score
                self.cache_hook.add_partial("loglikelihood", requests[index][0], score)
            progress.update(len(indices))
        progress.close()
        self._report_cuts()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents; the budget is a fraction of the tokens scored together (of the
        window for a document past it, which a policy that streams reads whole)."""
        results = []
        for request in self._bar(requests, disable=disable_tqdm, desc="h2o rolling"):
            total = 0.0
            for context, continuation in self._rolling_windows(self.tok_encode(request.args[0])):
                ((score, _),) = continuation_scores(
                    self.model,
                    self._cache(len(context) + len(continuation), 0),
                    context,
                    [continuation],
                    self.settings.chunk,
                )
                total += score
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
            results.append(total)
        return results

    def _rolling_windows(self, ids: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, continuation) pairs that predict every token of a document, the first from the prefix token.

        One pair when the cache can take the whole document (it fits in the window, or an evicting policy on
        rolling positions goes any length); otherwise lm-eval's rolling windows of `max_length` tokens, as
        its own hf model scores them.
        """
        if self.streams or len(ids) + 1 <= self.max_length:
            return [([self.prefix_token_id], ids)]
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows = get_rolling_token_windows(
            token_list=ids, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
        )
        return [make_disjoint_window(window) for window in windows]

    def _split_question(self, context: str) -> tuple[list[int], list[int]]:
        """(text ids, question ids): for a policy that recalls and a context past the window, the context's
        last line (at most a chunk of tokens) is its question, read as `h2o stream --prompt` reads one
        (`NewChunk`: its queries alone choose what is brought back, the lead head's choice after it);
        otherwise (ids, []), as before inside the window."""
        ids, cut = self.tok_encode(context), context.rfind("\n") + 1
        if (
            policy_class(self.settings.policy).recalls
            and len(ids) > self.max_length
            and 0 < cut < len(context)
        ):
            question = self.tok_encode(context[cut:])
            if len(question) <= self.settings.chunk:
                return self.tok_encode(context[:cut]), question
        return ids, []

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy answers. A context past the window is read whole by a policy that streams (in chunks, the
        budget the window's), cut to its last `window - max_gen_toks` tokens otherwise."""
        results = []
        for request in self._bar(requests, disable=disable_tqdm, desc="h2o generate"):
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", 256))
            text_ids, question = self._split_question(context)
            ids = self._fit(text_ids + question, max_new)
            text_ids, question = (
                (ids, []) if len(ids) < len(text_ids) + len(question) else (text_ids, question)
            )
            text = greedy_answer(
                self.model,
                self.tokenizer,
                self._cache(len(ids), max_new),
                text_ids,
                max_new,
                self.settings.chunk,
                until,
                question,
            )
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            results.append(text)
        self._report_cuts()
        return results


def join_processes(device: str | None) -> tuple[int, int]:
    """(rank, world size): (0, 1) in a single process; under `accelerate launch` / torchrun (`$WORLD_SIZE` > 1)
    joins their process group (gloo on the CPU, nccl on GPUs) once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        gpus = str(device or "cpu").startswith(("cuda", "auto")) and torch.cuda.is_available()
        if gpus:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if gpus else "gloo")
    return dist.get_rank(), dist.get_world_size()
