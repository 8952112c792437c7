"""The Runner: the step path every model shares.

Be paranoid about changing this file and more paranoid about adding lines: anything that only
some models need belongs in a ``ModelState`` subclass or a plugin hook, never here.

One step (``execute``): drop finished rows, add new ones (staged writes), send the step's small
integer arrays in one packed copy, build inputs on the device with the prep kernels, ask the
ModelState for model inputs and attention metadata, run the forward, sample, write the sampled
tokens back into the state table on the device, and start the copy of the tokens to the host.
It returns without waiting: ``AsyncStepOutput.result()`` is the only wait.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import numpy as np
import torch

from mrv2.attention.context import ForwardContext, set_forward_context
from mrv2.config import EngineConfig
from mrv2.model_loader.build import CausalLM, build_model, load_hf_config, resolve_dtype
from mrv2.plugins import PluginManager, get_plugin_manager, import_object
from mrv2.runner.async_output import AsyncStepOutput, PinnedRing
from mrv2.runner.cuda_graphs import DecodeGraphs, capture_sizes
from mrv2.runner.input_batch import InputBatch, InputBuffers
from mrv2.runner.kv_cache import allocate_kv_caches, kv_layer_specs, num_blocks_for
from mrv2.runner.model_state import ModelState
from mrv2.runner.scheduler_output import NewRequest, SchedulerOutput
from mrv2.runner.staged_edits import StagedEdits
from mrv2.runner.staging import Uploader
from mrv2.runner.state_table import RequestStateTable, RowInfo
from mrv2.sample.prompt_logprobs import PromptChunk, PromptLogprobs, compute_prompt_logprobs
from mrv2.sample.sampler import SamplerOutput
from mrv2_kernels.input_prep import post_update, prepare_inputs


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='cpu'")
    return torch.device(name)


class Runner:
    """Runs scheduled steps of one model on one device.

    Build it with :meth:`from_config`. Bring-your-own-scheduler users call :meth:`execute` with
    a :class:`SchedulerOutput` per step and read :attr:`num_kv_blocks` / :attr:`block_size` to
    manage KV blocks themselves; ``execute`` adds and removes requests as the output says.
    """

    def __init__(
        self, config: EngineConfig, model_dir: str, plugins: PluginManager | None = None
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.plugins = plugins or get_plugin_manager()
        self.device = resolve_device(config.device.device)
        self.hf_config = load_hf_config(model_dir)
        self.dtype = resolve_dtype(config.model.dtype, self.hf_config, self.device)
        self.max_model_len = _max_model_len(config, self.hf_config)
        self.block_size = config.cache.block_size
        registries = self.plugins.registries
        self.model, entry = build_model(
            config, model_dir, self.hf_config, registries, self.device, self.dtype
        )
        self.vocab_size = int(self.hf_config.vocab_size)

        sched = config.scheduler
        self.max_num_reqs = sched.max_num_seqs
        self.max_num_tokens = sched.max_num_batched_tokens
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.table = RequestStateTable(
            self.max_num_reqs, self.max_model_len, self.max_blocks_per_req, self.device
        )
        self.buffers = InputBuffers(
            self.max_num_tokens, self.max_num_reqs, self.max_blocks_per_req, self.device
        )
        state_cls = import_object(entry.model_state) if entry.model_state else ModelState
        self.model_state: ModelState = state_cls(
            self.model, self.hf_config, config, self.buffers, self.block_size, self.device
        )
        backend_entry = registries.attention_backend_for(
            self.device.type, config.device.attention_backend
        )
        self.attn_backend = import_object(backend_entry.target)()
        hook = self.plugins.hook
        self.sampler = hook.mrv2_make_sampler(
            config=config, registries=registries, vocab_size=self.vocab_size, device=self.device
        )
        speculator = hook.mrv2_make_speculator(
            config=config, registries=registries, model=self.model, device=self.device
        )
        if speculator is not None:
            raise NotImplementedError("speculative decoding is not supported by this runner yet")
        # Per-step hooks, resolved once.
        self._hook_add = hook.mrv2_add_request
        self._hook_remove = hook.mrv2_remove_request
        self._hook_mm = hook.mrv2_get_mm_embeddings
        self._hook_inputs = hook.mrv2_prepare_inputs
        self._hook_attn = hook.mrv2_prepare_attn

        self._num_tokens_cpu = np.zeros(self.max_num_reqs, dtype=np.int64)
        self.kv_specs = kv_layer_specs(self.model)
        peak = self._profile_peak_bytes()
        self.num_kv_blocks = num_blocks_for(
            config.cache, self.kv_specs, self.dtype, self.device, peak
        )
        self.kv_caches = allocate_kv_caches(
            self.kv_specs, self.num_kv_blocks, self.block_size, self.dtype, self.device
        )
        self._uploader = Uploader(self.device)
        self._out_ring = PinnedRing(self.max_num_reqs, self.device)
        self._copy_stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.device.enforce_eager:
            self.graphs = DecodeGraphs(capture_sizes(self.max_num_reqs))
            with torch.inference_mode():
                self.graphs.capture_all(self._graph_dummy_batch, self._forward_logits,
                                        self._capture)

    @classmethod
    def from_config(cls, config: EngineConfig, plugins: PluginManager | None = None) -> Runner:
        """Build a runner for ``config.model.model`` (the default model when unset)."""
        model_dir = config.model.model
        if model_dir is None:
            from mrv2.model_loader.default_model import ensure_default_model

            model_dir = str(ensure_default_model())
        return cls(config, model_dir, plugins)

    # -- requests ----------------------------------------------------------------------------

    def _add_request(self, request: NewRequest, staged: StagedEdits) -> None:
        n = len(request.token_ids)
        if not 0 < n <= self.max_model_len:
            raise ValueError(
                f"request {request.req_id!r} has {n} tokens; allowed 1..{self.max_model_len}"
            )
        if len(request.block_ids) > self.max_blocks_per_req:
            raise ValueError(f"request {request.req_id!r} holds too many blocks")
        params = request.sampling_params
        row = self.table.allocate(RowInfo(
            req_id=request.req_id, prefill_len=n, num_computed=request.num_computed_tokens,
            greedy=params.greedy, top_k=params.top_k > 0, top_p=params.top_p < 1.0,
            min_p=params.min_p > 0.0, params=params,
        ))
        if params.uses_penalties:
            self.table.ensure_penalty_state(self.vocab_size)
            staged.add_prompt_mask(row, request.token_ids, params.prompt_len(n))
        self._num_tokens_cpu[row] = n
        staged.add_tokens(row, request.token_ids)
        staged.add_blocks(row, 0, request.block_ids)
        self.table.num_blocks[row] = len(request.block_ids)
        staged.add_row(row, params, request.seed, request.num_computed_tokens, n)
        self._hook_add(model_state=self.model_state, request=request, row=row)

    def remove_requests(self, req_ids: list[str]) -> None:
        """Free the rows of finished, aborted or preempted requests (``execute`` does it too)."""
        for req_id in req_ids:
            row = self.table.release(req_id)
            self._hook_remove(model_state=self.model_state, req_id=req_id, row=row)

    # -- the step ----------------------------------------------------------------------------

    def execute(self, scheduled: SchedulerOutput) -> AsyncStepOutput:
        """Run one step; returns at once with a handle on its sampled tokens."""
        self.remove_requests(scheduled.finished_req_ids)
        staged = StagedEdits()
        for request in scheduled.new_requests:
            self._add_request(request, staged)
        for req_id, block_ids in scheduled.new_block_ids.items():
            row = self.table.row_of(req_id)
            start = int(self.table.num_blocks[row])
            if start + len(block_ids) > self.max_blocks_per_req:
                raise ValueError(f"request {req_id!r} would hold more blocks than max_model_len")
            staged.add_blocks(row, start, block_ids)
            self.table.num_blocks[row] = start + len(block_ids)
        batch, replay = self._build_batch(scheduled, staged)
        with torch.inference_mode():
            sampled, prompt_lps = self._forward_and_sample(batch, replay)
        return self._start_output_copy(batch, sampled, prompt_lps)

    def _build_batch(
        self, scheduled: SchedulerOutput, staged: StagedEdits
    ) -> tuple[InputBatch, bool]:
        """The step's inputs on the device, and whether a captured graph runs it."""
        req_ids = list(scheduled.num_scheduled_tokens)
        num_reqs = len(req_ids)
        if not 0 < num_reqs <= self.max_num_reqs:
            raise ValueError(f"a step needs 1..{self.max_num_reqs} requests, got {num_reqs}")
        rows = np.empty(num_reqs, dtype=np.int32)
        lens = np.empty(num_reqs, dtype=np.int32)
        do_sample = np.empty(num_reqs, dtype=bool)
        max_seq_len = 0
        all_greedy, any_min_p, any_top = True, False, False
        for i, req_id in enumerate(req_ids):  # check everything before changing anything
            row = self.table.row_of(req_id)
            n = scheduled.num_scheduled_tokens[req_id]
            waiting = int(self._num_tokens_cpu[row]) - self.table.info[row].num_computed
            if not 0 < n <= waiting:
                raise ValueError(f"request {req_id!r}: scheduled {n} tokens but only "
                                 f"{waiting} are waiting to be computed")
            rows[i], lens[i] = row, n
        num_tokens = int(lens.sum())
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"{num_tokens} tokens scheduled; at most {self.max_num_tokens}")
        for i, row in enumerate(rows.tolist()):
            info = self.table.info[row]
            known = int(self._num_tokens_cpu[row])
            info.num_computed += int(lens[i])
            do_sample[i] = info.num_computed == known
            if do_sample[i]:
                self._num_tokens_cpu[row] = known + 1
            max_seq_len = max(max_seq_len, info.num_computed)
            all_greedy &= info.greedy
            any_min_p |= info.min_p
            any_top |= info.top_k or info.top_p
        uniform_decode = num_tokens == num_reqs
        self._prompt_chunks = self._prompt_logprob_chunks(req_ids, rows, lens)
        padded = (self.graphs.padded_size(num_reqs)
                  if self.graphs and uniform_decode and not self._prompt_chunks else None)
        num_padded = padded or num_reqs
        num_tokens_padded = padded or num_tokens
        query_start_loc = np.full(num_padded + 1, num_tokens, dtype=np.int32)
        query_start_loc[0] = 0
        np.cumsum(lens, out=query_start_loc[1 : num_reqs + 1])

        arrays: dict[str, np.ndarray] = {
            "idx_mapping": rows, "query_start_loc": query_start_loc,
            "do_sample": do_sample.astype(np.int32),
        }
        arrays.update(staged.arrays())
        dev = self._uploader.upload(arrays)
        staged.apply(dev, self.table)

        buffers = self.buffers
        buffers.idx_mapping[:num_reqs].copy_(dev["idx_mapping"])
        buffers.query_start_loc[: num_padded + 1].copy_(dev["query_start_loc"])
        num_block_cols = min(-(-max_seq_len // self.block_size), self.max_blocks_per_req)
        prepare_inputs(
            buffers.idx_mapping[:num_reqs], buffers.query_start_loc[: num_padded + 1], num_reqs,
            self.table.token_ids, self.table.num_computed, self.table.block_table,
            self.block_size, buffers.input_ids[:num_tokens_padded],
            buffers.positions[:num_tokens_padded], buffers.slot_mapping[:num_tokens_padded],
            buffers.seq_lens[:num_padded], buffers.block_table[:num_padded], num_block_cols,
        )
        torch.sub(buffers.query_start_loc[1 : num_reqs + 1], 1,
                  out=buffers.logits_indices[:num_reqs])
        self._do_sample_dev = dev["do_sample"]
        batch = InputBatch(
            req_ids=req_ids, num_reqs=num_reqs, num_reqs_padded=num_padded,
            num_tokens=num_tokens, num_tokens_padded=num_tokens_padded,
            max_query_len=int(lens.max()), max_seq_len=max_seq_len,
            uniform_decode=uniform_decode, do_sample=do_sample,
            idx_mapping=buffers.idx_mapping[:num_reqs],
            query_start_loc=buffers.query_start_loc[: num_padded + 1],
            input_ids=buffers.input_ids[:num_tokens_padded],
            positions=buffers.positions[:num_tokens_padded],
            slot_mapping=buffers.slot_mapping[:num_tokens_padded],
            seq_lens=buffers.seq_lens[:num_padded],
            block_table=buffers.block_table[:num_padded, :num_block_cols],
            logits_indices=buffers.logits_indices[:num_reqs],
            all_greedy=all_greedy, any_min_p=any_min_p, any_top_k_top_p=any_top,
            idx_mapping_cpu=rows,
        )
        return batch, padded is not None

    def _prompt_logprob_chunks(
        self, req_ids: list[str], rows: np.ndarray, lens: np.ndarray
    ) -> list[PromptChunk]:
        """Where this step's prompt tokens of ``prompt_logprobs`` requests lie (CPU only)."""
        if self.table.num_special == 0:
            return []
        chunks, start = [], 0
        for req_id, row, n in zip(req_ids, rows.tolist(), lens.tolist(), strict=True):
            info = self.table.info[row]
            params = info.params
            if params is not None and params.prompt_logprobs is not None:
                k = params.prompt_logprobs
                position = info.num_computed - n
                prompt_len = params.prompt_len(info.prefill_len)
                count = max(0, min(position + n, prompt_len - 1) - position)
                if count:
                    chunks.append(PromptChunk(req_id, row, start, position, count, k))
            start += n
        return chunks

    def _forward(self, batch: InputBatch) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        for extra in reversed(self._hook_inputs(model_state=self.model_state, batch=batch)):
            if extra:
                kwargs.update(extra)
        mm = self._hook_mm(model_state=self.model_state, batch=batch)
        if mm is not None:
            kwargs["mm_embeddings"] = mm
        metadata = self._hook_attn(model_state=self.model_state, batch=batch)
        context = ForwardContext(metadata, self.kv_caches, self.attn_backend)
        with set_forward_context(context):
            hidden = self.model(**kwargs)
        return cast(torch.Tensor, hidden)

    def _forward_logits(self, batch: InputBatch) -> torch.Tensor:
        """Logits of every token of a uniform-decode batch (the body of a captured graph)."""
        hidden = self._forward(batch)
        return cast(CausalLM, self.model).compute_logits(hidden)

    def _graph_dummy_batch(self, size: int) -> InputBatch:
        batch = self.plugins.hook.mrv2_prepare_dummy_inputs(
            model_state=self.model_state, num_reqs=size, num_tokens=size
        )
        # Graphs serve any length up to max_model_len: bake that bound, not the dummy's.
        return replace(batch, max_seq_len=self.max_model_len, uniform_decode=True,
                       block_table=self.buffers.block_table[:size])

    def _capture(self, batch: InputBatch, forward: Any) -> Any:
        return self.plugins.hook.mrv2_capture_cuda_graph(
            model_state=self.model_state, batch=batch, forward=forward
        )

    def _forward_and_sample(
        self, batch: InputBatch, replay: bool
    ) -> tuple[SamplerOutput, list[PromptLogprobs]]:
        prompt_lps: list[PromptLogprobs] = []
        model = cast(CausalLM, self.model)
        if replay:
            assert self.graphs is not None
            logits = self.graphs.replay(batch.num_reqs_padded)[: batch.num_reqs]
        else:
            hidden = self._forward(batch)
            logits = model.compute_logits(hidden[batch.logits_indices])
            if self._prompt_chunks:
                prompt_lps = compute_prompt_logprobs(hidden, model.compute_logits, self.table,
                                                     self._prompt_chunks)
        out = self.sampler(logits, batch, self.table)
        if isinstance(out, torch.Tensor):  # a plugin sampler returning bare tokens
            out = SamplerOutput(out)
        post_update(
            batch.idx_mapping, batch.query_start_loc, batch.num_reqs, out.tokens,
            self._do_sample_dev, self.table.token_ids, self.table.num_computed,
            self.table.num_tokens,
        )
        self.table.record_sampled(batch.idx_mapping, out.tokens, self._do_sample_dev)
        return out, prompt_lps

    def _start_output_copy(
        self, batch: InputBatch, out: SamplerOutput, prompt_lps: list[PromptLogprobs]
    ) -> AsyncStepOutput:
        host, slot = self._out_ring.take()
        sampled = out.tokens
        # Logprobs (rare) travel in fresh host tensors on the same stream, under the same event.
        extras = [t for t in (out.logprob_ids, out.logprobs, out.sampled_rank) if t is not None]
        for p in prompt_lps:
            extras += [p.ids, p.logprobs, p.ranks]
        pinned = self._copy_stream is not None
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in extras]
        if self._copy_stream is None:
            host[: batch.num_reqs].copy_(sampled)
            for h, t in zip(hosts, extras, strict=True):
                h.copy_(t)
            event = None
        else:
            self._copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._copy_stream):
                host[: batch.num_reqs].copy_(sampled, non_blocking=True)
                sampled.record_stream(self._copy_stream)
                for h, t in zip(hosts, extras, strict=True):
                    h.copy_(t, non_blocking=True)
                    t.record_stream(self._copy_stream)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            self._out_ring.set_event(slot, event)
        result = AsyncStepOutput(batch.req_ids, batch.do_sample, host, event)
        if out.logprob_ids is not None:
            result.set_logprobs(hosts[0], hosts[1], hosts[2])
        base = 3 if out.logprob_ids is not None else 0
        for i, p in enumerate(prompt_lps):
            ids, values, ranks = hosts[base + 3 * i : base + 3 * i + 3]
            result.add_prompt_logprobs(p.req_id, p.first_position, ids, values, ranks)
        return result

    # -- start-up ----------------------------------------------------------------------------

    def _profile_peak_bytes(self) -> int:
        """Activation memory of the largest step, measured by one dummy forward (CUDA only)."""
        if self.device.type != "cuda" or self.config.cache.num_gpu_blocks_override is not None:
            return 0
        self.kv_caches = allocate_kv_caches(self.kv_specs, 1, self.block_size, self.dtype,
                                            self.device)
        num_tokens = self.max_num_tokens
        num_reqs = min(self.max_num_reqs, num_tokens)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        batch = self.plugins.hook.mrv2_prepare_dummy_inputs(
            model_state=self.model_state, num_reqs=num_reqs, num_tokens=num_tokens
        )
        with torch.inference_mode():
            hidden = self._forward(batch)
            cast(CausalLM, self.model).compute_logits(hidden[batch.logits_indices]).float()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return int(peak)


def _max_model_len(config: EngineConfig, hf_config: Any) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    requested = config.model.max_model_len
    if requested is None:
        if limit is None:
            raise ValueError(
                "max_model_len is required: config.json has no max_position_embeddings"
            )
        return int(limit)
    if limit is not None and requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}"
        )
    return requested
