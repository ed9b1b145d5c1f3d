"""The serving engine: continuous batching over a hybrid cache, sampling, stop conditions and
prefix reuse.

Shape legend: B running requests, V vocabulary.

Each `step()`:

1. admits waiting requests while fewer than `max_batch_size` run: each prompt is prefilled on
   its own (batch 1, chunked, extracting the Mamba state at the end of the prompt), its first
   token sampled, and its cache joined to the running batch with `HybridCache.cat` (the batch is
   right-aligned, so requests of any length share one decode step);
2. runs one decode step for every running request: one [B, 1] forward, then the logits
   processors of the rows that need them (logit bias, min_tokens, repetition / frequency /
   presence penalties, a structured-output `TokenConstraint` mask; `infer.sampling` gives the
   order, which is vLLM's), one argmax for the greedy rows and per-row sampling with each
   request's own temperature / min-p / top-k / top-p and seeded generator;
3. retires finished requests (EOS, stop token, stop string, max_tokens, max_model_len, a
   finished constraint) and drops their rows with `HybridCache.select`.

On CUDA (`cuda_graphs`, default on there) the running batch does not live in a growing
`HybridCache` but in a `model.slots.SlotCache`: static buffers with one row per request, which
an admitted request's prefilled cache is copied into (`put`) and a finished one leaves by
moving the rows above it down (`keep`). Decode and verification steps are then captured CUDA
graphs (`infer.graphs`), and a verification's per-row rollback is a device-side rewind, so the
steps below run the same with no column padding, trimming or compaction. Prefill, sampling
and drafting stay eager.

Speculative requests (`params.speculative = k > 0`, `infer.speculative`) run in the same batch
and prefix cache. Their prefill also runs the MTP module over the prompt (so a prefix entry
keeps the MTP cache at its boundary too). In a step where any row speculates, the speculative
rows draft together, one MTP call per draft position over their MTP caches kept as one batch
(`speculative.draft_batch`; each row drafts its own k, scoring only `draft_vocab`'s ids when
given), and one [B, J] forward, J = 1 + the longest draft, verifies every row at once: a
speculative row feeds [next token, drafts], a plain row its next token followed by padding it
then drops. The forward keeps every Mamba state per position (`HybridCache.record_history`) and
`rewind_rows` keeps each row's accepted prefix: Mamba states picked per row, dropped attention
columns masked as padding (`compact` closes those holes when they outgrow the valid columns,
and every step for models with sliding windows, which count columns). Greedy speculative rows
emit exactly the plain greedy tokens; sampled ones follow the target distribution (rejection
sampling). With `spec_max_batch=N` speculation runs only while at most N requests run (vLLM's
`disable_by_batch_size`): a larger batch decodes one token per row, the speculative rows
sampling theirs from the backbone's logits and queueing the MTP inputs (run in one call per
`mtp_queue_limit` steps) until speculation resumes.

Prefix reuse: prompts are prefilled in segments that end on multiples of `prefix_block` tokens
and the cache at each boundary is kept (attention KV as views of the request's buffers, so no
copy; the Mamba conv and SSM states at the boundary, which are immutable tensors) in an LRU of
`prefix_cache_size` entries keyed by the prefix tokens. A later prompt that starts with a kept
prefix forks that cache and prefills only the rest; the result is exactly that of a full prefill
(tested). Mamba state cannot be recovered at arbitrary positions without a snapshot, which is why
boundaries are block-aligned (as vLLM's prefix caching does for Mamba layers).

Penalties keep per-request state only for the requests that use them: a [V] count of the
generated tokens and a [V] mask of the tokens seen (prompt and generated), updated as tokens are
appended; the processors run batched over the rows that need them, never over the vocabulary in
Python. `min_tokens` masks EOS and `stop_token_ids` until that many tokens were generated, and a
stop string counts only if it ends in text generated after them (vLLM's rule).

For the API's log-probs, `SamplingParams(top_logprobs=k)` returns each generated token's
log-prob under the raw model distribution (log_softmax of the logits before any processing, as
vLLM by default) with the k most likely tokens (`RequestOutput.top_logprobs`), and
`prompt_logprobs=k` the same for every prompt token after the first (`RequestOutput.
prompt_logprobs`, for completions' `echo`): the prefill then skips the prefix cache and scores
each prefill segment's logits as it goes (the engine's own prefill, so the numbers are those of
the decode that follows; they equal `eval.loglik`'s up to float rounding). With `max_tokens=0`
such a request only runs the prefill.

A constraint (`SamplingParams.constraint`, a factory called once per sequence) masks each step's
logits; it is advanced with every appended token and ends the request with "stop" when it is
finished. A constraint that allows nothing ends its request with "stop"; one that raises ends
only its request (finish reason "abort", `RequestOutput.error` set).

Reasoning budget (`SamplingParams.max_thinking_tokens=N`, Nemotron 3 Super §4.4): once N tokens
were generated inside the reply's `<think>` block (opened by the reply, or by the prompt when it
ends inside one), the next tokens are forced to close it, `</think>` on its own line as the chat
template writes it, and decoding continues with the answer. Forced tokens override the other
logits processors (their log-probs are the model's, as for sampled tokens); a speculative row's
round that would run past the budget keeps only the tokens before the cut, and the closing tag
is then verified as known drafts. A reply that opens no block is not affected.

For RL rollouts: `SamplingParams(logprobs=True)` returns each sampled token's log-prob under
softmax(logits / T) (what the trainer recomputes; `sampled_logprobs`), including that of the EOS /
stop token that ended the request; `update_weights` loads new weights between steps while
requests are in flight, and every token carries the weight version that sampled it.

Text is streamed safely: `delta_text` never contains half of a UTF-8 character nor the start of
a stop string that may still complete.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..data.chat import THINK_CLOSE, THINK_OPEN
from ..model.attention import Attention
from ..model.cache import HybridCache
from ..model.model import HybridLM
from ..model.slots import SlotCache
from ..model.state_precision import check_precision
from ..precision.kv_cache import kv_codecs
from .graphs import DecodeGraphs, cache_forward, decode_graphs
from .sampling import (
    SamplingParams,
    TokenConstraint,
    TokenLogprob,
    apply_penalties,
    sample_next,
    sampled_logprobs,
    top_logprobs,
)
from .speculative import (
    DraftVocab,
    MTPDrafter,
    SpeculativeDecoder,
    consume_batch,
    consume_slots,
    draft_batch,
    draft_slots,
)

log = logging.getLogger("hybridlm.engine")


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far (stop-trimmed once finished)
    text: str  # detokenised generated text so far (stable, stop string removed)
    delta_text: str  # text added since this request's previous output
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    spec_stats: object | None = None  # SpecStats when speculative
    # with params.logprobs: log-prob of each token of token_ids under softmax(logits / T)
    logprobs: list[float] | None = None
    # the engine's weight version that sampled each token (changes on update_weights)
    token_versions: list[int] = field(default_factory=list)
    # the EOS / stop token that ended the request (not in token_ids) and its log-prob
    stop_token_id: int | None = None
    stop_token_logprob: float | None = None
    # with params.top_logprobs: each token of token_ids with its raw log-prob and top-k
    top_logprobs: list[TokenLogprob] | None = None
    # with params.prompt_logprobs: the same for the prompt (None for its first token)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # set when the request's constraint failed (finish reason "abort")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class _Thinking:
    """A request's reasoning budget (`SamplingParams.max_thinking_tokens`): "before" until the
    reply shows whether it opens a `<think>` block, "open" inside it (`start`: tokens generated
    before its first reasoning token), "closed" after it, or when the reply opens none."""

    budget: int
    state: str = "before"
    start: int = 0


class _Prefix(NamedTuple):
    cache: HybridCache  # a `prefix_view`, forked on use
    logits: torch.Tensor  # of the last prefix position
    mtp: tuple[HybridCache, torch.Tensor] | None  # MTP cache view, last position's hidden


@dataclass
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    emitted_tokens: int = 0
    emitted_text: int = 0
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    next_token: int | None = None  # sampled, not yet fed to the model
    spec: SpeculativeDecoder | None = None  # speculative requests: drafts and acceptance
    logprobs: list[float] = field(default_factory=list)  # aligned with tokens (params.logprobs)
    versions: list[int] = field(default_factory=list)  # aligned with tokens
    stop_token: tuple[int, float | None] | None = None
    api_logprobs: list[TokenLogprob] = field(default_factory=list)  # params.top_logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None
    constraint: TokenConstraint | None = None
    counts: torch.Tensor | None = None  # [V] generated-token counts (penalties)
    seen: torch.Tensor | None = None  # [V] bool: in the prompt or generated (repetition)
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values) of logit_bias
    stop_from: int | None = None  # stop strings must end after this character (min_tokens)
    error: str | None = None
    think: _Thinking | None = None  # params.max_thinking_tokens
    forced: list[int] = field(default_factory=list)  # tokens the next steps must emit


class Engine:
    def __init__(
        self,
        model: HybridLM,
        tokenizer,
        *,
        max_batch_size: int = 8,
        max_model_len: int | None = None,
        ssm_precision: str = "fp32",
        kv_cache_dtype: str = "auto",
        prefix_block: int = 64,
        prefix_cache_size: int = 32,
        draft_vocab: DraftVocab | None = None,
        spec_max_batch: int | None = None,
        cuda_graphs: bool | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefix_block < 1:
            raise ValueError(f"prefix_block must be >= 1, got {prefix_block}")
        if spec_max_batch is not None and spec_max_batch < 1:
            raise ValueError(f"spec_max_batch must be >= 1 or None, got {spec_max_batch}")
        if model.config.vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                f"{model.config.vocab_size}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len or model.config.max_seq_len
        self.ssm_precision = check_precision(ssm_precision)
        # the attention KV cache's storage (precision/kv_cache.py): codecs per attention block
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_codecs = kv_codecs(model, kv_cache_dtype)
        self.prefix_block = prefix_block
        self.prefix_cache_size = prefix_cache_size
        self.draft_vocab = draft_vocab
        self.spec_max_batch = spec_max_batch
        self.mtp_queue_limit = 32  # MTP pairs a row queues without drafting before they run
        # a cache with holes is compacted once its columns exceed twice its longest row + this
        self.compact_slack = 64
        self.device = model.embeddings.weight.device
        # sliding windows count cache columns: batches with holes are compacted every step
        self._windowed = any(
            isinstance(m, Attention) and m.window is not None for m in model.modules()
        )
        # the running batch's cache as static slots with captured decode steps (on CUDA by
        # default; `infer.graphs`); a verification writes up to 1 + 16 drafts past a row's end
        self._graphs = decode_graphs(
            self.model,
            max_batch_size,
            self.max_model_len + 17,
            ssm_precision=self.ssm_precision,
            kv_codecs=self.kv_codecs,
            cuda_graphs=cuda_graphs,
            verify=model.mtp is not None,
        )
        # the speculative rows' MTP caches as slots too, indexed as the batch's rows
        self._mtp_graphs = None
        if (
            self._graphs is not None
            and model.mtp is not None
            and "M" not in model.config.mtp.pattern
        ):
            mtp_slots = SlotCache(
                self.model,
                max_batch_size,
                self.max_model_len + 17,
                pattern=model.config.mtp.pattern,
            )
            self._mtp_graphs = DecodeGraphs(self.model, mtp_slots, capture=self._graphs.capture)
        self._ids = itertools.count()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # rows of self._cache, in order
        self._cache: HybridCache | None = None
        # the MTP caches of the speculative rows, in their order in `_running`
        self._mtp_cache: HybridCache | None = None
        # prefix tokens -> (cache view, last logits, MTP part or None: the MTP cache view over
        # the positions before the last one and that position's backbone hidden state)
        self._prefixes: OrderedDict[tuple[int, ...], _Prefix] = OrderedDict()
        self.weight_version = 0
        self.stats = {
            "prefill_tokens": 0,
            "prefix_hit_tokens": 0,
            "decode_steps": 0,
            "verify_steps": 0,  # decode steps in which speculative rows verified drafts
            "max_running": 0,
        }

    # ------------------------------------------------------------------ requests
    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        params.validate()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; this model takes at most "
                f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})"
            )
        V = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            raise ValueError(f"prompt token ids must be in [0, {V})")
        if params.speculative:
            self.model.check_drafter("speculative decoding")
        if params.logit_bias and max(params.logit_bias) >= V:
            raise ValueError(f"logit_bias token ids must be in [0, {V})")
        if any(not 0 <= t < V for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {V})")
        rid = request_id or f"req-{next(self._ids)}"
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else torch.seed() % 2**63)
        req = _Request(rid, prompt, params, gen)
        if params.counts_tokens:
            req.counts = torch.zeros(V, dtype=torch.float32, device=self.device)
            req.seen = torch.zeros(V, dtype=torch.bool, device=self.device)
            req.seen[torch.tensor(prompt, device=self.device)] = True
        if params.logit_bias:
            ids, vals = zip(*sorted(params.logit_bias.items()), strict=True)
            req.bias = (
                torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(vals, dtype=torch.float32, device=self.device),
            )
        if params.constraint is not None:
            req.constraint = params.constraint()  # one per sequence
        if params.max_thinking_tokens is not None:
            req.think = _Thinking(params.max_thinking_tokens)
            text = self.tokenizer.decode(prompt)
            opened = text.rfind(THINK_OPEN)
            if opened >= 0 and THINK_CLOSE not in text[opened:]:
                req.think.state = "open"  # the prompt ends inside a reasoning block
                if params.max_thinking_tokens == 0:
                    self._force_close(req, text)
        self._waiting.append(req)
        return rid

    def abort(self, request_id: str) -> None:
        for r in [*self._waiting, *self._running]:
            if r.id == request_id and not r.finished:
                r.finished, r.finish_reason = True, "abort"

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def num_running(self) -> int:
        return len(self._running)

    @torch.no_grad()
    def update_weights(
        self, state_dict: dict[str, torch.Tensor], version: int | None = None
    ) -> int:
        """Load new weights in place between steps (asynchronous RL, PipelineRL-style in-flight
        updates, Olmo 3 §4.4): requests in flight keep their caches, which were computed with
        the old weights, and continue with the new ones; every token records the version that
        sampled it (`RequestOutput.token_versions`). The prefix cache is cleared, as its entries
        belong to the old weights. Returns the new version (default: the old one + 1)."""
        if version is not None and version < self.weight_version:
            raise ValueError(
                f"weight version {version} is older than the engine's {self.weight_version}"
            )
        self.model.load_state_dict(state_dict, strict=True)
        if self.draft_vocab is not None:
            self.draft_vocab.refresh()
        self._prefixes.clear()
        self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self._drop_aborted(outputs)
        while self._waiting and self.num_running() < self.max_batch_size:
            req = self._waiting.popleft()
            if req.finished:
                outputs.append(self._output(req))
                continue
            if req.params.max_tokens == 0:
                if req.params.prompt_logprobs is not None:  # completions' echo: score only
                    req.prompt_logprobs = self._prefill(req.prompt, req.params.prompt_logprobs)[2]
                self._finish(req, "length")
                outputs.append(self._output(req))
            else:
                self._admit(req, outputs)
        self.stats["max_running"] = max(self.stats["max_running"], self.num_running())
        if self._running:
            self._decode(outputs)
        return outputs

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion; final outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams or one per prompt")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    # ------------------------------------------------------------------ prefill
    def _admit(self, req: _Request, outputs: list[RequestOutput]) -> None:
        if req.params.speculative:
            req.spec = self._decoder(req)
            cache, logits, _, h_11D = self._prefill(req.prompt, drafter=req.spec.drafter)
            tok = req.forced[0] if req.forced else req.spec.sample(logits[None])
            req.spec.advance(h_11D, [tok])  # MTP's last prompt position sees the first token
            outputs.extend(self._append(req, req.spec.emit([tok])))
        else:
            cache, logits, req.prompt_logprobs, _ = self._prefill(
                req.prompt, req.params.prompt_logprobs
            )
            toks, lps, api = self._sample(logits[None], [req])
            if req.finished:  # its constraint allowed nothing, or failed
                outputs.append(self._output(req))
                return
            tok = int(toks[0])
            outputs.extend(self._append(req, [tok], lps, api))
        if req.finished:
            return
        req.next_token = tok
        if self._graphs is not None:
            self._graphs.slots.put(len(self._running), cache)
            batch = None
        else:
            batch = cache if self._cache is None else HybridCache.cat([self._cache, cache])
        mtp_batch = self._mtp_cache
        if req.spec is not None and self._mtp_graphs is not None:
            self._mtp_graphs.slots.put(len(self._running), req.spec.drafter.cache)
        elif req.spec is not None:
            mtp = req.spec.drafter.cache
            mtp_batch = mtp if mtp_batch is None else HybridCache.cat([mtp_batch, mtp], self.device)
        self._running.append(req)
        self._cache, self._mtp_cache = batch, mtp_batch

    def _prefill(
        self,
        prompt: list[int],
        prompt_logprobs: int | None = None,
        drafter: MTPDrafter | None = None,
    ) -> tuple[HybridCache, torch.Tensor, list[TokenLogprob | None] | None, torch.Tensor | None]:
        """Batch-1 prefill with prefix reuse; returns (cache, logits of the last position, with
        `prompt_logprobs=k` every prompt token's `TokenLogprob` with its top k, None for the
        first: then every position is computed, so the prefix cache is not read; and with a
        `drafter` the last position's hidden state [1, 1, D]). A `drafter` (speculative
        requests) has the MTP module run over the prompt as it is prefilled, up to the last
        position, which waits for the first generated token; only prefix entries that kept
        the MTP cache serve such a prefill."""
        blk = self.prefix_block
        start, cache, logits, h_11D = 0, None, None, None
        scored: list[TokenLogprob | None] | None = None
        if prompt_logprobs is not None:
            scored = [None]
        for b in range((len(prompt) // blk) * blk if scored is None else 0, 0, -blk):
            hit = self._prefixes.get(tuple(prompt[:b]))
            if hit is not None and (drafter is None or hit.mtp is not None):
                self._prefixes.move_to_end(tuple(prompt[:b]))
                cache, logits = hit.cache.fork(), hit.logits
                if drafter is not None:
                    drafter.cache, h_11D = hit.mtp[0].fork(), hit.mtp[1]
                start = b
                self.stats["prefix_hit_tokens"] += b
                break
        if cache is None:
            cache = HybridCache.for_pattern(
                self.model.config.pattern,
                ssm_precision=self.ssm_precision,
                kv_codecs=self.kv_codecs,
            )
        bounds = list(range(start + blk, len(prompt) + 1, blk))
        if start < len(prompt) and (not bounds or bounds[-1] != len(prompt)):
            bounds.append(len(prompt))
        for end in bounds:
            ids = torch.tensor([prompt[start:end]], device=self.device)
            out = self.model(ids, cache=cache, return_hidden=drafter is not None)
            logits_TV = out.logits[0]
            logits = logits_TV[-1]
            if scored is not None:  # position t predicts prompt[t + 1]
                targets = torch.tensor(prompt[start + 1 : end + 1], device=self.device)
                scored += top_logprobs(logits_TV[: len(targets)], targets, prompt_logprobs)
            if drafter is not None:  # MTP position t sees (h_t, x_{t+1}), x_{t+1} in the prompt
                h_BLD = out.hidden if h_11D is None else torch.cat([h_11D, out.hidden], dim=1)
                if h_BLD.shape[1] > 1:
                    first = end - h_BLD.shape[1]  # position of h_BLD's first row
                    drafter.feed(h_BLD[:, :-1], ids.new_tensor([prompt[first + 1 : end]]))
                    drafter.consume()
                h_11D = h_BLD[:, -1:]
            self.stats["prefill_tokens"] += end - start
            if end % blk == 0 and self.prefix_cache_size > 0:
                self._keep_prefix(prompt[:end], cache, logits, drafter, h_11D)
            start = end
        return cache, logits, scored, h_11D

    def _keep_prefix(
        self,
        prefix: list[int],
        cache: HybridCache,
        logits: torch.Tensor,
        drafter: MTPDrafter | None,
        h_11D: torch.Tensor | None,
    ) -> None:
        key = tuple(prefix)
        old = self._prefixes.get(key)
        if old is not None and old.mtp is not None and drafter is None:
            self._prefixes.move_to_end(key)  # keep the entry that also serves speculation
            return
        mtp = None if drafter is None else (drafter.cache.prefix_view(), h_11D)
        self._prefixes[key] = _Prefix(cache.prefix_view(), logits, mtp)
        self._prefixes.move_to_end(key)
        while len(self._prefixes) > self.prefix_cache_size:
            self._prefixes.popitem(last=False)

    # ------------------------------------------------------------------ decode
    def _decode(self, outputs: list[RequestOutput]) -> None:
        reqs = self._running
        spec = [i for i, r in enumerate(reqs) if r.spec is not None]
        if spec and (self.spec_max_batch is None or len(reqs) <= self.spec_max_batch):
            self._verify(outputs, spec)
            return
        # one token per row; speculative rows (speculation paused: more rows than
        # `spec_max_batch`) sample theirs without drafts and queue its MTP input
        x_B1 = torch.tensor([[r.next_token] for r in reqs], device=self.device)
        logits_BLV, hidden_BLD = self._forward(x_B1, return_hidden=bool(spec))
        logits_BV = logits_BLV[:, -1]
        self.stats["decode_steps"] += 1
        plain = [i for i in range(len(reqs)) if reqs[i].spec is None]
        if plain:
            self._emit_sampled(reqs, plain, logits_BV[plain], outputs)
        for i in spec:
            r = reqs[i]
            new = [r.forced[0] if r.forced else r.spec.sample(logits_BV[i : i + 1])]
            self._emit_speculative(r, new, hidden_BLD[i : i + 1], outputs)
        if spec and any(reqs[i].spec.drafter.queued() >= self.mtp_queue_limit for i in spec):
            if self._mtp_graphs is not None:
                consume_slots({i: reqs[i].spec for i in spec}, len(reqs), self._mtp_graphs)
            else:
                consume_batch([reqs[i].spec for i in spec], self._mtp_cache)
        self._retire_finished()

    def _forward(
        self, ids_BL: torch.Tensor, *, return_hidden: bool, history: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The running batch's forward over its cache: logits [B, L, V] and hidden states
        [B, L, D] (with `return_hidden`); `history` keeps the Mamba states per position for a
        per-row rewind (speculative verification)."""
        if self._graphs is not None:
            return self._graphs.forward(ids_BL, history=history)
        return cache_forward(
            self.model, ids_BL, self._cache, history=history, return_hidden=return_hidden
        )

    def _emit_sampled(
        self,
        reqs: list[_Request],
        rows: list[int],
        logits_BV: torch.Tensor,
        outputs: list[RequestOutput],
    ) -> None:
        """Sample one token for each of `rows` (of `reqs`) from its logits row and append it."""
        sub = [reqs[i] for i in rows]
        toks, lps, api = self._sample(logits_BV, sub)
        for j, (r, t) in enumerate(zip(sub, toks.tolist(), strict=True)):
            if r.finished:  # its constraint allowed nothing, or failed, in `_sample`
                outputs.append(self._output(r))
                continue
            outputs.extend(
                self._append(
                    r,
                    [t],
                    lps[j : j + 1] if lps is not None else None,
                    api[j : j + 1] if api is not None else None,
                )
            )
            r.next_token = t

    def _emit_speculative(
        self, r: _Request, new: list[int], hidden_1LD: torch.Tensor, outputs: list[RequestOutput]
    ) -> int:
        """Append the tokens a speculative row's step produced, after [its next token, new but
        the last] ran through the backbone with hidden states `hidden_1LD`; a reasoning budget
        may take only the first of them. Returns how many were taken: the cache keeps
        [next token, the taken ones but the last], and the last is the next token."""
        new = new[: self._thinking_cut(r, new)]
        if not r.spec.finishes(new):
            r.spec.advance(hidden_1LD[:, : len(new)], new)
            r.next_token = new[-1]
        emitted = r.spec.emit(new)
        outputs.extend(self._append(r, emitted, thinking_cut=len(emitted)))
        return len(new)

    def _verify(self, outputs: list[RequestOutput], spec_rows: list[int]) -> None:
        """One step of a batch with speculative rows (`spec_rows`; module docstring): drafts of
        every speculative row in one MTP call per position, one [B, J] forward, per-row
        acceptance, per-row rollback of the cache."""
        reqs = self._running
        # rows owing a spent reasoning budget's closing tag draft nothing: the tag goes in as
        # known drafts (up to the tokens left)
        limits = [0 if reqs[i].forced else None for i in spec_rows]
        if self._mtp_graphs is not None:
            drafts = draft_slots(
                {i: reqs[i].spec for i in spec_rows},
                len(reqs),
                self._mtp_graphs,
                dict(zip(spec_rows, limits, strict=True)),
            )
        else:
            batch = draft_batch([reqs[i].spec for i in spec_rows], self._mtp_cache, limits)
            drafts = dict(zip(spec_rows, batch, strict=True))
        for i in spec_rows:
            r = reqs[i]
            if r.forced:
                left = r.spec.tokens_left()
                drafts[i] = (r.forced[: left if left is not None else len(r.forced)], None)
        J = 1 + max(len(d) for d, _ in drafts.values())
        rows = []
        for i, r in enumerate(reqs):
            seq = [r.next_token, *drafts.get(i, ((), None))[0]]
            rows.append(seq + [seq[-1]] * (J - len(seq)))  # padding, dropped by rewind_rows
        logits_BJV, hidden_BJD = self._forward(
            torch.tensor(rows, device=self.device), return_hidden=True, history=True
        )
        self.stats["decode_steps"] += 1
        self.stats["verify_steps"] += 1
        keep = [1] * len(reqs)
        plain = [i for i in range(len(reqs)) if i not in drafts]
        if plain:
            self._emit_sampled(reqs, plain, logits_BJV[plain, 0], outputs)
        for i, (d, q_KV) in drafts.items():
            r = reqs[i]
            if r.forced:  # all accepted, then (unless they end the request) a sampled token
                new = list(d)
                if len(d) == len(r.forced):
                    new.append(r.spec.sample(logits_BJV[i, len(d) : len(d) + 1]))
            else:
                new = r.spec.judge(logits_BJV[i, : len(d) + 1], d, q_KV)[1]
            keep[i] = self._emit_speculative(r, new, hidden_BJD[i : i + 1], outputs)
        if self._graphs is not None:
            self._graphs.rewind(keep)
        else:
            self._cache.rewind_rows(torch.tensor(keep), J)
        self._retire_finished()
        for c, windowed in ((self._cache, self._windowed), (self._mtp_cache, False)):
            if (
                c is not None
                and c.padded
                and (windowed or c.seen_tokens > 2 * int(c.positions_B.max()) + self.compact_slack)
            ):
                c.compact()

    def _sample(
        self, logits_BV: torch.Tensor, reqs: list[_Request]
    ) -> tuple[torch.Tensor, list[float] | None, list[TokenLogprob | None] | None]:
        """Logits processors on the rows that need them, then greedy rows by one argmax and
        sampled rows each with their own settings and generator. Returns the tokens and, when
        any row asks for them, every row's RL log-prob (raw logits / T) and API `TokenLogprob`
        (raw logits; None for rows that did not ask)."""
        logits = self._process(logits_BV, reqs)
        out = logits.argmax(-1)
        for i, r in enumerate(reqs):
            p = r.params
            if not p.greedy and not r.finished:
                out[i] = sample_next(
                    logits[i : i + 1],
                    temperature=p.temperature,
                    top_k=p.top_k,
                    top_p=p.top_p,
                    min_p=p.min_p,
                    generator=r.generator,
                )[0]
        lps = None
        if any(r.params.logprobs for r in reqs):
            temps = torch.tensor([r.params.temperature for r in reqs], device=logits_BV.device)
            temps = torch.where(temps > 0, temps, torch.ones_like(temps))[:, None]
            lps = sampled_logprobs(logits_BV / temps, out, temperature=1.0).tolist()
        api = None
        rows = [i for i, r in enumerate(reqs) if r.params.top_logprobs is not None]
        if rows:
            api = [None] * len(reqs)
            k = max(reqs[i].params.top_logprobs for i in rows)
            idx = torch.tensor(rows, device=logits_BV.device)
            for i, tl in zip(rows, top_logprobs(logits_BV[idx], out[idx], k), strict=True):
                keep = reqs[i].params.top_logprobs
                api[i] = TokenLogprob(tl.token_id, tl.logprob, tl.top[:keep])
        return out, lps, api

    def _process(self, logits_BV: torch.Tensor, reqs: list[_Request]) -> torch.Tensor:
        """The logits processors, in vLLM's order (see `infer.sampling`), batched over the rows
        that need each: logit_bias, min_tokens' mask of EOS / stop_token_ids, the penalties,
        the constraint's mask, then forced tokens (a spent reasoning budget's closing tag).
        Returns `logits_BV` itself when no row needs any."""
        bias = [i for i, r in enumerate(reqs) if r.bias is not None]
        early = [i for i, r in enumerate(reqs) if len(r.tokens) < r.params.min_tokens]
        pen = [i for i, r in enumerate(reqs) if r.counts is not None]
        masks = self._constraint_masks(reqs)
        forced = [i for i, r in enumerate(reqs) if r.forced and not r.finished]
        if not (bias or early or pen or masks or forced):
            return logits_BV
        device = logits_BV.device
        logits = logits_BV.double() if logits_BV.dtype == torch.float64 else logits_BV.float()
        logits = logits.clone()
        if bias:
            rows = torch.cat([torch.full_like(reqs[i].bias[0], i) for i in bias])
            cols = torch.cat([reqs[i].bias[0] for i in bias])
            vals = torch.cat([reqs[i].bias[1] for i in bias]).to(logits.dtype)
            logits.index_put_((rows, cols), vals, accumulate=True)
        if early:
            rows, cols = [], []
            for i in early:
                p = reqs[i].params
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else [self.tokenizer.eos_id])
                rows += [i] * len(banned)
                cols += banned
            if cols:
                logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = (
                    float("-inf")
                )
        if pen:
            idx = torch.tensor(pen, device=device)
            logits[idx] = apply_penalties(
                logits[idx],
                torch.stack([reqs[i].counts for i in pen]),
                torch.stack([reqs[i].seen for i in pen]),
                repetition_B=torch.tensor([reqs[i].params.repetition_penalty for i in pen]),
                frequency_B=torch.tensor([reqs[i].params.frequency_penalty for i in pen]),
                presence_B=torch.tensor([reqs[i].params.presence_penalty for i in pen]),
            ).to(device)
        if masks:
            rows = list(masks)
            idx = torch.tensor(rows, device=device)
            allowed = torch.stack([masks[i] for i in rows])
            logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
            for i in rows:
                if reqs[i].finished:  # nothing allowed: no NaN from an all -inf row
                    logits[i] = 0.0
        for i in forced:  # the reasoning budget's closing tag overrides every other processor
            logits[i] = float("-inf")
            logits[i, reqs[i].forced[0]] = 0.0
        return logits

    def _constraint_masks(self, reqs: list[_Request]) -> dict[int, torch.Tensor]:
        """Row -> bool [V] mask of the rows whose constraint restricts this step. A request whose
        constraint allows nothing finishes ("stop"; `_process` zeroes its row, so that nothing
        samples from all -inf), one whose constraint raises finishes too ("abort", with the
        error); the token sampled for either is dropped."""
        V = self.model.config.vocab_size
        out: dict[int, torch.Tensor] = {}
        for i, r in enumerate(reqs):
            if r.constraint is None or r.finished:
                continue
            try:
                m = r.constraint.allowed()
            except Exception as err:
                self._constraint_failed(r, err)
                continue
            if m is None:
                continue
            m = m.to(device=self.device, dtype=torch.bool).reshape(-1)
            if m.numel() != V:  # ids past the mask's end are not allowed
                m = torch.nn.functional.pad(m[:V], (0, max(0, V - m.numel())), value=False)
            if not bool(m.any()):
                self._finish(r, "stop")
            out[i] = m
        return out

    def _constraint_failed(self, req: _Request, err: Exception) -> None:
        log.exception("the constraint of request %s failed", req.id)
        req.error = f"the structured-output constraint failed: {type(err).__name__}: {err}"
        self._finish(req, "abort")

    def _drop_aborted(self, outputs: list[RequestOutput]) -> None:
        outputs.extend(self._output(r) for r in self._running if r.finished)
        self._retire_finished()

    def _retire_finished(self) -> None:
        """Drop finished requests from the running batch and their rows from its cache."""
        keep = [i for i, r in enumerate(self._running) if not r.finished]
        if len(keep) < len(self._running):
            spec = [r for r in self._running if r.spec is not None]
            keep_spec = [j for j, r in enumerate(spec) if not r.finished]
            if self._mtp_graphs is not None:
                self._mtp_graphs.slots.keep(keep)
            elif len(keep_spec) < len(spec):
                self._mtp_cache = self._mtp_cache.select(keep_spec) if keep_spec else None
            self._running = [self._running[i] for i in keep]
            if self._graphs is not None:
                self._graphs.slots.keep(keep)
            else:
                self._cache = self._cache.select(keep) if keep else None

    # ------------------------------------------------------------------ speculative
    def _decoder(self, req: _Request) -> SpeculativeDecoder:
        """The drafting and acceptance state of a speculative request; its backbone rows live
        in the batch cache."""
        p = req.params
        return SpeculativeDecoder(
            self.model,
            req.prompt,
            draft_len=p.speculative,
            max_new_tokens=min(p.max_tokens, self.max_model_len - len(req.prompt)),
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            generator=req.generator,
            eos_id=None if p.ignore_eos else self.tokenizer.eos_id,
            stop_token_ids=p.stop_token_ids,
            draft_vocab=self.draft_vocab,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    # ------------------------------------------------------------------ bookkeeping
    def _append(
        self,
        req: _Request,
        toks: list[int],
        logprobs: list[float] | None = None,
        api: list[TokenLogprob | None] | None = None,
        *,
        thinking_cut: int | None = None,
    ) -> list[RequestOutput]:
        """Add sampled tokens (and their log-probs), advance the penalty counts and the
        constraint, apply the stop conditions and the reasoning budget (`thinking_cut` tokens
        were already cut by the caller); returns the request's output."""
        p = req.params
        eos = self.tokenizer.eos_id
        if thinking_cut is None:
            thinking_cut = self._thinking_cut(req, toks)
        toks = toks[:thinking_cut]
        for j, t in enumerate(toks):
            lp = logprobs[j] if logprobs is not None and p.logprobs else None
            if (not p.ignore_eos and t == eos) or t in p.stop_token_ids:
                self._finish(req, "stop")
                req.stop_token = (t, lp)
                break
            req.tokens.append(t)
            req.versions.append(self.weight_version)
            if lp is not None:
                req.logprobs.append(lp)
            if api is not None and api[j] is not None:
                req.api_logprobs.append(api[j])
            if req.counts is not None:
                req.counts[t] += 1
                req.seen[t] = True
            if req.constraint is not None:
                try:
                    req.constraint.accept(t)
                    done = req.constraint.finished()
                except Exception as err:
                    self._constraint_failed(req, err)
                    break
                if done:
                    self._finish(req, "stop")
                    break
            if len(req.tokens) >= p.max_tokens or len(req.prompt) + len(req.tokens) >= (
                self.max_model_len
            ):
                self._finish(req, "length")
                break
        text = self.tokenizer.decode(req.tokens)
        if p.stop and len(req.tokens) > p.min_tokens:  # vLLM: none within the first min_tokens
            if req.stop_from is None:
                head = self.tokenizer.decode(req.tokens[: p.min_tokens]) if p.min_tokens else ""
                req.stop_from = len(head.rstrip("\ufffd"))
            hits = []
            for s in p.stop:  # a stop string must end after the first min_tokens tokens' text
                at = text.find(s, max(0, req.stop_from - len(s) + 1))
                if at >= 0:
                    hits.append((at, len(s)))
            if hits:
                at, n = min(hits)
                text = text[: at + n] if p.include_stop_str_in_output else text[:at]
                req.tokens = self._tokens_covering(req.tokens, len(text))
                n_tok = len(req.tokens)
                del req.versions[n_tok:], req.logprobs[n_tok:], req.api_logprobs[n_tok:]
                req.stop_token = None
                if req.finish_reason != "abort":
                    self._finish(req, "stop", keep_reason=False)
        req.text = text
        return [self._output(req)]

    def _thinking_cut(self, req: _Request, new: list[int]) -> int:
        """How many of `new` (tokens about to be appended) the request takes under its
        reasoning budget: all, unless the budget runs out inside an open `<think>` block after
        the first c of them; then c, and the closing tag (`THINK_CLOSE` on its own line, the
        chat template's layout) is queued in `req.forced` for the next steps. Forced tokens at
        the front of `new` are taken off the queue; the thinking state follows the tokens."""
        n_forced = 0
        while n_forced < min(len(new), len(req.forced)) and new[n_forced] == req.forced[n_forced]:
            n_forced += 1
        del req.forced[:n_forced]
        th = req.think
        if th is None or th.state == "closed":
            return len(new)
        tokens = req.tokens + new
        base = len(req.tokens)
        for j in range(len(new)):
            n = base + j + 1  # tokens generated with new[j]
            if th.state == "before":
                head = self.tokenizer.decode(tokens[:n]).lstrip()
                if head.startswith(THINK_OPEN):
                    th.state, th.start = "open", n
                elif not THINK_OPEN.startswith(head.rstrip("\ufffd")):
                    th.state = "closed"  # the reply does not reason
                    return len(new)
            elif THINK_CLOSE in self.tokenizer.decode(tokens[max(th.start, n - 16) : n]):
                th.state = "closed"  # closed by the model (or by the forced tag)
                return len(new)
            if th.state == "open" and n - th.start >= th.budget and j >= n_forced:
                before = self.tokenizer.decode(req.prompt) if th.start == 0 else THINK_OPEN
                self._force_close(req, before + self.tokenizer.decode(tokens[th.start : n]))
                return j + 1
        return len(new)

    def _force_close(self, req: _Request, reasoning: str) -> None:
        """Queue the closing tag of the reasoning block, on its own line as the chat template
        writes it (`reasoning` ends where the block now ends)."""
        close = THINK_CLOSE + "\n" if reasoning.endswith("\n") else f"\n{THINK_CLOSE}\n"
        req.forced = self.tokenizer.encode(close, add_bos=False)

    def _tokens_covering(self, tokens: list[int], n_chars: int) -> list[int]:
        """The shortest token prefix whose text covers the first `n_chars` characters."""
        for n in range(len(tokens) + 1):
            if len(self.tokenizer.decode(tokens[:n]).rstrip("\ufffd")) >= n_chars:
                return tokens[:n]
        return tokens

    def _finish(self, req: _Request, reason: str, *, keep_reason: bool = True) -> None:
        if not req.finished or not keep_reason:
            req.finished, req.finish_reason = True, reason

    def _stable_len(self, req: _Request) -> int:
        """Length of the text that can be streamed: not a trailing partial UTF-8 character, nor
        a suffix that may grow into a stop string."""
        text = req.text
        if req.finished:
            return len(text)
        n = len(text)
        while n and text[n - 1] == "\ufffd":
            n -= 1
        hold = 0
        for s in req.params.stop:
            for k in range(min(len(s) - 1, n), hold, -1):
                if text[n - k : n] == s[:k]:
                    hold = k
                    break
        return n - hold

    def _output(self, req: _Request) -> RequestOutput:
        n = max(self._stable_len(req), req.emitted_text)
        delta_text = req.text[req.emitted_text : n]
        delta_ids = req.tokens[req.emitted_tokens :]
        req.emitted_text, req.emitted_tokens = n, len(req.tokens)
        stats = getattr(req.spec, "stats", None) if req.spec is not None else None
        return RequestOutput(
            request_id=req.id,
            prompt_token_ids=req.prompt,
            token_ids=list(req.tokens),
            text=req.text[:n] if not req.finished else req.text,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            finished=req.finished,
            finish_reason=req.finish_reason,
            spec_stats=stats,
            logprobs=list(req.logprobs) if req.params.logprobs else None,
            token_versions=list(req.versions),
            stop_token_id=req.stop_token[0] if req.stop_token else None,
            stop_token_logprob=req.stop_token[1] if req.stop_token else None,
            top_logprobs=(list(req.api_logprobs) if req.params.top_logprobs is not None else None),
            prompt_logprobs=req.prompt_logprobs,
            error=req.error,
        )
