"""The Runner: the step path every model shares.

Be paranoid about changing this file and more paranoid about adding lines: anything that only
some models need belongs in a ``ModelState`` subclass, a sampler or speculator plugin, or a
KV cache spec and its backend, never here.

One step (``execute``): drop finished rows, add new ones (staged writes), send the step's small
integer arrays in one packed copy, build inputs on the device with the prep kernels, ask the
ModelState for model inputs and attention metadata, run the forward, sample (verifying drafts
when the step carries them), write the step's tokens back into the state table on the device,
let the speculator propose the next drafts, and start the copy of the tokens to the host.
It returns without waiting: ``AsyncStepOutput.result()`` is the only wait.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import numpy as np
import torch

from mrv2.config import EngineConfig
from mrv2.contract.batch import InputBatch, InputBuffers
from mrv2.contract.forward_context import ForwardContext, set_forward_context
from mrv2.contract.model_state import ModelState
from mrv2.contract.requests import NewRequest, SchedulerOutput
from mrv2.contract.samples import SpeculatorInputs, StepSamples
from mrv2.contract.staged_edits import StagedEdits
from mrv2.contract.staging import Uploader
from mrv2.contract.state_table import RequestStateTable
from mrv2.distributed.parallel_state import agree_min, tp_rank, tp_size
from mrv2.layers.attention import config_sliding_window, disable_sliding_windows
from mrv2.lora import make_lora_manager
from mrv2.model_loader.build import (
    CausalLM,
    build_model,
    load_hf_config,
    resolve_dtype,
    text_config_of,
)
from mrv2.model_loader.classification import score_head
from mrv2.plugins import PluginManager, get_plugin_manager
from mrv2.runner.admission import (
    add_requests,
    check_prompt_embeds,
    engine_max_model_len,
    kv_dtype_name,
    remove_requests,
)
from mrv2.runner.async_output import AsyncStepOutput, PinnedRing
from mrv2.runner.batch_builder import BatchBuilder, StepPlan
from mrv2.runner.between_steps import BetweenSteps
from mrv2.runner.capture import (
    capture_set,
    max_mixed_graph_tokens,
    profile_peak_bytes,
)
from mrv2.runner.cuda_graphs import (
    Outputs,
    StepGraphs,
)
from mrv2.runner.kv_cache import KVCaches, fit_max_model_len, num_blocks_for
from mrv2.runner.kv_tables import plan_tables, table_metadata, with_dummy_tables, without_windows
from mrv2.runner.pooling import Pooled, RowPooler
from mrv2.runner.sleep import Sleeper
from mrv2.runner.startup import StartupReport, device_bytes_in_use
from mrv2.runner.state_rows import StateRows
from mrv2.sample.prompt_logprobs import PromptLogprobs
from mrv2.sample.rejection import kept_token_logprobs, step_samples
from mrv2.sample.sampler import SamplePlan, Sampler, SamplerOutput
from mrv2_kernels.input_prep import post_update

#: What :meth:`Runner.shutdown` lets go of: everything that holds device memory.
_DEVICE_STATE = ("model", "model_state", "kv", "table", "buffers", "builder", "sampler",
                 "speculator", "lora", "pooler", "_out_ring", "_uploader", "_no_drafts",
                 "_draft_offsets", "_ones", "_all_drafts", "_copy_stream", "_last_copy")


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='cpu'")
    return torch.device(name)


class Runner(BetweenSteps):
    """Runs scheduled steps of one model on one device.

    Build it with :meth:`from_config`. Bring-your-own-scheduler users call :meth:`execute` with
    a :class:`SchedulerOutput` per step and read :attr:`num_kv_blocks` / :attr:`block_size` to
    manage KV blocks themselves; ``execute`` adds and removes requests as the output says.
    """

    #: ``execute`` calls ``SchedulerOutput.fill_token_bitmasks`` between the forward and the
    #: sampling (a subclass whose steps also run elsewhere forwards the masks there, as the
    #: tensor-parallel runner does, or sets this False: the engine then fills masks early).
    late_token_masks = True

    def __init__(
        self, config: EngineConfig, model_dir: str, plugins: PluginManager | None = None
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        if config.parallel.tensor_parallel_size != tp_size():
            raise ValueError(
                f"tensor_parallel_size={config.parallel.tensor_parallel_size} but this process "
                f"is in a group of {tp_size()}: build the runner with mrv2.executor.make_runner "
                "(LLMEngine does), which starts the other ranks")
        self.plugins = plugins or get_plugin_manager()
        self.device = resolve_device(config.device.device)
        #: Each start-up part's seconds and findings (logged at INFO by rank 0).
        self.startup = StartupReport(quiet=tp_rank() != 0)
        with self.startup.part("config"):  # mostly transformers' import (see StartupReport)
            self.hf_config = load_hf_config(model_dir, config.model.hf_overrides)
        self.dtype = resolve_dtype(config.model.dtype, self.hf_config, self.device)
        #: The window ``disable_sliding_window`` caps ``max_model_len`` to (None: the flag is
        #: off, or the model has no window: nothing changes), as vLLM's.
        self.disabled_window = (config_sliding_window(text_config_of(self.hf_config))
                                if config.model.disable_sliding_window else None)
        self.max_model_len = engine_max_model_len(config, text_config_of(self.hf_config),
                                                  self.disabled_window)
        config.scheduler.fit_token_budget(self.max_model_len)  # (before the buffers)
        self.block_size = config.cache.block_size
        registries = self.plugins.registries
        with self.startup.part("load"):
            self.model, self.model_entry = build_model(
                config, model_dir, self.hf_config, registries, self.device, self.dtype
            )
        if self.disabled_window is not None:  # (before any cache spec is read)
            disable_sliding_windows(self.model)
        self.startup.weights(self.model_entry.architecture, self.model, tp_size())
        self.vocab_size = int(text_config_of(self.hf_config).vocab_size)

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
        self.pooler = RowPooler(score_head(self.model))  # pooling requests' rows
        #: The adapter slots when the engine serves LoRA adapters (``enable_lora``), else None.
        self.lora = make_lora_manager(config, self.model, self.max_num_reqs,
                                      self.max_num_tokens, self.device, self.dtype)
        entry = self.model_entry
        state_cls = entry.load("model_state") if entry.model_state else ModelState
        self.model_state: ModelState = state_cls(
            self.model, self.hf_config, config, self.buffers, self.block_size, self.device
        )
        hook = self.plugins.hook
        self.sampler: Sampler = hook.mrv2_make_sampler(
            config=config, registries=registries, vocab_size=self.vocab_size, device=self.device
        )
        self.speculator = hook.mrv2_make_speculator(
            config=config, registries=registries, model_state=self.model_state,
            device=self.device,
        )
        #: Per-request state (:mod:`mrv2.contract.request_state`): its report, its rows per
        #: request and prefix caching's snapshot table.
        self.state_rows = StateRows(self.model_state, self.max_num_reqs, self.device,
                                    self.startup)
        self.keeps_request_state = self.state_rows.enabled
        if self.speculator is not None:
            self.speculator.bind_sampling(getattr(self.sampler, "state", None))
        self.num_speculative_tokens = (
            self.speculator.num_speculative_tokens if self.speculator is not None else 0
        )
        specs = self.model_state.kv_cache_specs()
        if self.speculator is not None:  # a drafter's own cache layers, numbered after these
            # (on table 0: the drafter's metadata is built over it)
            specs = {**specs, **without_windows(self.speculator.kv_cache_specs(len(specs)))}
        # (a model of state-space layers only has no KV cache layer: its blocks are the
        # scheduler's bookkeeping and prefix caching's hashes, no memory)
        self.kv = KVCaches(specs, registries, self.device, config.device.attention_backend,
                           config.cache.kv_cache_dtype, allow_empty=self.keeps_request_state,
                           owner=entry.plugin)
        self.kv.layout = plan_tables(specs, self.block_size, self.max_model_len)
        #: Each block table's sliding window (None: full attention), table 0 first: the
        #: scheduler frees a sliding table's blocks that fall out of its window.
        self.kv_table_windows = self.kv.layout.windows
        self.table.add_block_tables(self.kv.layout.num_tables - 1)
        self.buffers.add_block_tables(self.kv.layout.num_tables - 1)
        self.builder = BatchBuilder(self.table, self.buffers, self.block_size,
                                    self.max_num_tokens, self.num_speculative_tokens)
        self.builder.mixed_graph_allowed = check_prompt_embeds(self)
        per_block = self.kv.bytes_per_block(self.block_size, self.dtype)
        with self.startup.part("kv_cache"):
            peak = self._profile_peak_bytes()
            self.num_kv_blocks = agree_min(num_blocks_for(  # every rank holds as many
                config.cache, per_block, self.device, peak
            )) if per_block else (config.cache.num_gpu_blocks_override
                                  or self.max_num_reqs * self.max_blocks_per_req)
            self.kv.allocate(self.num_kv_blocks, self.block_size, self.dtype, self.device)
        if config.model.auto_max_model_len:  # (what reads it from here on sees its length)
            self._fit_max_model_len(per_block)
        self.startup.kv_cache(self.num_kv_blocks, self.block_size, per_block,
                              kv_dtype_name(config.cache.kv_cache_dtype, self.dtype),
                              self.max_model_len, peak, self.kv_table_windows)
        if self.speculator is not None:
            self.speculator.bind_kv_caches(self.kv.tensors, self.kv.backends)
        self._uploader = Uploader(self.device)
        self._out_ring = PinnedRing(self.max_num_reqs * (1 + self.num_speculative_tokens),
                                    self.device)
        self._no_drafts = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=self.device)
        self._draft_offsets = torch.arange(self.num_speculative_tokens, device=self.device)
        self._ones = torch.ones(self.max_num_reqs, dtype=torch.int32, device=self.device)
        self._all_drafts = torch.full((self.max_num_reqs,), self.num_speculative_tokens,
                                      dtype=torch.int32, device=self.device)
        self._copy_stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        self._last_copy: torch.cuda.Event | None = None
        self.graphs: StepGraphs | None = None
        #: Serving LoRA adapters: the graphs without them and with them (:meth:`capture_graphs`).
        self._lora_graphs: tuple[StepGraphs, StepGraphs] | None = None
        #: What :meth:`capture_graphs` captured with (:meth:`wake_up` captures again).
        self._graph_capture: Callable[[InputBatch, Callable[[], Any]], object] | None = None
        self._sleeper = Sleeper(self.device)
        if self.device.type == "cuda" and not config.device.enforce_eager:
            self._capture_timed(self.model_state.capture_cuda_graph)

    def _capture_timed(self, capture: Callable[[InputBatch, Callable[[], Any]], object]
                       ) -> None:
        """:meth:`capture_graphs`, timed and reported as the start-up part ``graphs``."""
        in_use = device_bytes_in_use(self.device)
        with self.startup.part("graphs"):
            self.capture_graphs(capture)
        self.startup.graphs(self.graphs, device_bytes_in_use(self.device) - in_use,
                            2 if self._lora_graphs else 1)

    @classmethod
    def from_config(cls, config: EngineConfig, plugins: PluginManager | None = None) -> Runner:
        """Build a runner for ``config.model.model`` (the default model when unset)."""
        return cls(config, cls.resolve_model_dir(config), plugins)

    @staticmethod
    def resolve_model_dir(config: EngineConfig) -> str:
        """``config.model.model``, or the default model's directory (converted once)."""
        model_dir = config.model.model
        if model_dir is None:
            from mrv2.model_loader.default_model import ensure_default_model

            model_dir = str(ensure_default_model())
        return model_dir

    def shutdown(self) -> None:
        """Release what the runner holds: the CUDA graphs first (NCCL cannot finalize a
        communicator while a live graph holds collectives captured on it), then the device
        memory (the model, the KV cache, the state table, the buffers, the sampler's and the
        speculator's state), even while the runner is still referenced, so that the next
        engine of this process (a notebook's, a test's) finds the memory free; for a
        tensor-parallel runner, the workers too. Idempotent; the runner takes no steps
        afterwards (the engine refuses them)."""
        self._drop_graphs()
        cuda = getattr(self, "device", None) is not None and self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        if "_sleeper" in vars(self):
            self._sleeper.release()  # (its host copies: a sleeping engine shut down)
        for name in _DEVICE_STATE:
            vars(self).pop(name, None)
        gc.collect()  # (the model's modules reference each other)
        if cuda:
            torch.cuda.empty_cache()

    def _drop_graphs(self) -> None:
        self.graphs = self._lora_graphs = None
        if "builder" in vars(self):
            self.builder.graphs = None

    # -- requests ----------------------------------------------------------------------------

    def _add_requests(self, requests: list[NewRequest], staged: StagedEdits) -> None:
        """Give a step's new requests their rows (:func:`mrv2.runner.admission.add_requests`)."""
        add_requests(self, requests, staged)

    def remove_requests(self, req_ids: list[str]) -> None:
        """Free finished, aborted or preempted requests' rows (:func:`remove_requests`)."""
        remove_requests(self, req_ids)

    # -- the step ----------------------------------------------------------------------------

    def execute(self, scheduled: SchedulerOutput) -> AsyncStepOutput:
        """Run one step; returns at once with a handle on its tokens."""
        if self._sleeper.sleeping:
            raise RuntimeError(f"the runner is asleep ({', '.join(self.asleep)}): "
                               "wake_up() first")
        if scheduled.num_draft_tokens and self.speculator is None:
            raise ValueError("the step schedules draft tokens but no speculator is configured")
        self.builder.check(scheduled)  # everything, before any count or row changes
        self.remove_requests(scheduled.finished_req_ids)
        staged = StagedEdits()
        self._add_requests(scheduled.new_requests, staged)
        for req_id, block_ids in scheduled.new_block_ids.items():
            self.builder.stage_new_blocks(self.table.row_of(req_id), block_ids, staged)
        for req_id, tables in scheduled.new_extra_block_ids.items():
            for t, block_ids in enumerate(tables, 1):
                self.builder.stage_new_blocks(self.table.row_of(req_id), block_ids, staged, t)
        if self._lora_graphs is not None:  # (the step's rows are live now)
            assert self.lora is not None
            graphs = self._lora_graphs[self.lora.active]
            if graphs is not self.graphs:  # (setting the builder's drops its last layout)
                self.graphs = self.builder.graphs = graphs
        step = self.builder.build(scheduled, staged, self.sampler.plan, self._uploader)
        with torch.inference_mode():
            samples, out, prompt_lps, pooled = self._forward_and_sample(
                step, scheduled.fill_token_bitmasks)
        return self._start_output_copy(step, samples, out, prompt_lps, scheduled.copy_drafts,
                                       pooled)

    def _forward(self, batch: InputBatch) -> torch.Tensor:
        kwargs = self.model_state.prepare_inputs(batch)
        metadata = self.model_state.prepare_attn(batch)
        context = ForwardContext(metadata, self.kv.tensors, self.kv.backends,
                                 self.lora.forward_slots(batch) if self.lora else None)
        self.state_rows.bind(context, self.buffers.idx_mapping, metadata.num_reqs)
        if batch.table_inputs:  # sliding-window layers read block tables of their own
            context.table_metadata = table_metadata(metadata, batch)
            context.layer_tables = self.kv.layout.layer_tables
        with set_forward_context(context):
            hidden = self.model(**kwargs)
        return cast(torch.Tensor, hidden)

    def _forward_all_logits(self, batch: InputBatch) -> Outputs:
        """Hidden states and logits of every token of a uniform-decode batch (a graph's body)."""
        hidden = self._forward(batch)
        return hidden, cast(CausalLM, self.model).compute_logits(hidden)

    def _forward_logits_rows(self, batch: InputBatch) -> Outputs:
        """Hidden states of every token and logits of ``batch.logits_indices`` (a mixed graph's
        body)."""
        hidden = self._forward(batch)
        return hidden, cast(CausalLM, self.model).compute_logits(hidden[batch.logits_indices])

    def _dummy_batch(self, num_reqs: int, num_tokens: int) -> InputBatch:
        """The ModelState's dummy batch, the other block tables' buffers made harmless too."""
        return with_dummy_tables(self.model_state.prepare_dummy_inputs(num_reqs, num_tokens),
                                 self.buffers)

    def _mixed_dummy_batch(self, num_reqs: int, num_tokens: int, num_rows: int) -> InputBatch:
        batch = self._dummy_batch(num_reqs, num_tokens)
        indices = self.buffers.logits_indices
        # rows the dummy left unwritten (the default writes them all), as the builder pads them
        indices[batch.logits_indices.shape[0] : num_rows].fill_(num_tokens - 1)
        # Bake the bounds of any step this size serves, and its logits rows.
        return InputBatch(**{**batch.__dict__, "max_query_len": num_tokens,
                             "max_seq_len": self.max_model_len, "uniform_decode": False,
                             "block_table": self.buffers.block_table[:num_reqs],
                             "logits_indices": indices[:num_rows]})

    def _graph_dummy_batch(self, size: int, query_len: int) -> InputBatch:
        batch = self._dummy_batch(size, size * query_len)
        # Graphs serve any length up to max_model_len: bake that bound, not the dummy's.
        return InputBatch(**{**batch.__dict__, "max_seq_len": self.max_model_len,
                             "uniform_decode": True,
                             "block_table": self.buffers.block_table[:size]})

    def _forward_and_sample(
        self, step: StepPlan, before_sampling: Callable[[], None] | None = None,
    ) -> tuple[StepSamples, SamplerOutput, list[PromptLogprobs], Pooled | None]:
        """The step's forward, then (``before_sampling`` called in between, the forward
        launched) its sampling, post-update and drafting; embedding requests' pooled
        states."""
        batch = step.batch
        model = cast(CausalLM, self.model)
        if step.replay_query_len:
            assert self.graphs is not None
            hidden, logits = self.graphs.replay(step.replay_query_len, batch.num_reqs_padded)
        elif step.replay_tokens:  # a mixed graph: the builder padded the logits rows
            assert self.graphs is not None
            hidden, logits = self.graphs.replay_mixed(step.replay_tokens)
        else:
            hidden = self._forward(batch)
            logits = model.compute_logits(hidden[batch.logits_indices])
        if before_sampling is not None:
            before_sampling()
        tail = self._replay_tail(step, logits) if step.replay_query_len else None
        if tail is not None:  # sampled, verified and post-updated inside the tail graph
            sampled, verified = tail
            out = SamplerOutput(sampled[: batch.num_logits])
            samples = (step_samples(batch, out.tokens, step.do_sample_dev)
                       if verified is None else
                       StepSamples(verified.tokens[: batch.num_reqs],
                                   verified.num_sampled[: batch.num_reqs]))
            self.sampler.record_sampled(batch, samples)
            self._draft(step, samples, hidden)
            return samples, out, [], None  # (a decode step: no prompt completes)
        logits = logits[: batch.num_logits]  # a graph's padding rows off (eager: all of them)
        prompt_lps = self.sampler.prompt_logprobs(hidden, model.compute_logits, self.table,
                                                  step.sample_plan)
        out = self.sampler(logits, batch, self.table, step.sample_plan)
        if isinstance(out, torch.Tensor):  # a plugin sampler returning bare tokens
            out = SamplerOutput(out)
        samples = step_samples(batch, out.tokens, step.do_sample_dev, out.verify)
        out = kept_token_logprobs(batch, logits, out, samples, self.sampler.raw_logits)
        num_drafts = step.num_drafts_dev
        if num_drafts is None:
            num_drafts = self._no_drafts[: batch.num_reqs]
        post_update(
            batch.idx_mapping, batch.query_start_loc, batch.num_reqs, samples.tokens,
            samples.num_sampled, num_drafts, self.table.token_ids, self.table.num_computed,
            self.table.num_tokens,
        )
        self.sampler.record_sampled(batch, samples)
        pooled = self.pooler.pool(batch, hidden)
        self._draft(step, samples, hidden)
        return samples, out, prompt_lps, pooled

    def _draft(self, step: StepPlan, samples: StepSamples, hidden: torch.Tensor) -> None:
        """The speculator's drafting after a step: its graph when the step replayed one."""
        batch, graphs = step.batch, self.graphs
        if self.speculator is None:
            return
        if step.replay_query_len and graphs is not None and graphs.replay_drafts(
                step.replay_query_len, batch.num_reqs_padded, samples, after=self._last_copy):
            return
        self._propose(batch, samples, hidden)

    def _replay_tail(self, step: StepPlan, logits: torch.Tensor
                     ) -> tuple[torch.Tensor, StepSamples | None] | None:
        """The sampling tail graph's outputs for a decode step whose plan it captured (every
        request sampling; structured outputs' masks applied to the graph's ``logits`` first),
        or None: sample eagerly."""
        graphs, plan = self.graphs, step.sample_plan
        if graphs is None or not graphs.tail_graphs or not step.batch.do_sample.all():
            return None
        variant = self.sampler.graph_variant(plan)
        if variant is None or (step.replay_query_len, step.batch.num_reqs_padded,
                               variant) not in graphs.tail_graphs:
            return None
        if plan.bitmasks:  # (every token a logits row: the plan's rows are the graph's)
            self.sampler.apply_bitmasks(logits, plan)
        if self._last_copy is not None:  # the tail's buffers are the previous step's copy source
            torch.cuda.current_stream().wait_event(self._last_copy)
        return graphs.replay_tail(step.replay_query_len, step.batch.num_reqs_padded, variant)

    def _sample_tail(self, batch: InputBatch, logits: torch.Tensor, sampled: torch.Tensor,
                     samples: StepSamples | None, plan: SamplePlan | None = None) -> None:
        """The sampling tail graph's body over every row of a padded uniform-decode batch: the
        sampler's ``plan`` (default its ``graph_plan``) at every token into ``sampled``; with
        drafts (``1 + k`` tokens a request, ``samples`` given) their verification into
        ``samples``; then the post-update. Padding requests have empty queries: no tokens
        verified, rows untouched."""
        size = batch.num_reqs
        width = batch.num_tokens_padded // size  # tokens a request: every one is a logits row
        if samples is None:  # the builder wrote each request's seq_len (its token's position)
            batch = replace(batch, logits_idx_mapping=batch.idx_mapping,
                            logits_positions=self.buffers.logits_positions[:size])
        else:  # the step's logits rows are its tokens, whatever the builder wrote
            n = size * width
            rows = batch.idx_mapping[:, None].expand(size, width).reshape(n)
            batch = replace(
                batch, logits_idx_mapping=rows, logits_positions=batch.positions[:n] + 1,
                logits_indices=torch.arange(n, device=logits.device),
                num_draft_tokens=np.full(size, width - 1, dtype=np.int32),
                cu_num_logits=np.arange(size + 1, dtype=np.int32) * width,
                cu_num_logits_dev=batch.query_start_loc)  # the same when every token is a row
        out = self.sampler(logits, batch, self.table, plan or self.sampler.graph_plan)
        sampled.copy_(out.tokens)
        if samples is None:
            tokens, counts, drafts = sampled[:, None], self._ones[:size], self._no_drafts
        else:
            verified = step_samples(batch, out.tokens, self._ones[:size], out.verify)
            samples.tokens.copy_(verified.tokens)
            samples.num_sampled.copy_(verified.num_sampled)
            tokens, counts, drafts = samples.tokens, samples.num_sampled, self._all_drafts
        post_update(batch.idx_mapping, batch.query_start_loc, size, tokens, counts,
                    drafts[:size], self.table.token_ids, self.table.num_computed,
                    self.table.num_tokens)

    def _propose(self, batch: InputBatch, samples: StepSamples, hidden: torch.Tensor) -> None:
        """The speculator's drafting after a step (eager, or a drafting graph's body)."""
        assert self.speculator is not None
        inputs = SpeculatorInputs(None)
        if self.speculator.needs_hidden_states:
            inputs = self.model_state.speculator_inputs(batch, hidden)
        self.speculator.propose(batch, samples, inputs, self.table)

    def _start_output_copy(
        self, step: StepPlan, samples: StepSamples, out: SamplerOutput,
        prompt_lps: list[PromptLogprobs], copy_drafts: bool = False,
        pooled: Pooled | None = None,
    ) -> AsyncStepOutput:
        batch = step.batch
        tokens_buf, counts_buf, slot = self._out_ring.take()
        num_reqs, width = samples.tokens.shape
        host_tokens = tokens_buf[: num_reqs * width].view(num_reqs, width)
        host_counts = counts_buf[:num_reqs] if batch.max_draft_tokens else None
        sources = [(host_tokens, samples.tokens)]
        if host_counts is not None:
            sources.append((host_counts, samples.num_sampled))
        # Logprobs (rare) travel in fresh host tensors on the same stream, under the same event.
        extras = [t for t in (out.logprob_ids, out.logprobs, out.sampled_rank) if t is not None]
        for p in prompt_lps:
            extras += [p.ids, p.logprobs, p.ranks]
        if copy_drafts and self.speculator is not None:  # the drafts just proposed, by request
            extras.append(self._proposed_drafts(batch))
        num_pooled = len(pooled[1]) if pooled is not None else 0
        if pooled is not None:
            extras += pooled[1]
        pinned = self._copy_stream is not None
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in extras]
        sources += list(zip(hosts, extras, strict=True))
        event = None
        if self._copy_stream is None:
            for host, source in sources:
                host.copy_(source)
        else:
            self._copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._copy_stream):
                for host, source in sources:
                    host.copy_(source, non_blocking=True)
                    source.record_stream(self._copy_stream)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            self._out_ring.set_event(slot, event)
            self._last_copy = event
        result = AsyncStepOutput(batch.req_ids, batch.do_sample, host_tokens, host_counts, event,
                                 batch.cu_num_logits, step.drafted)
        if out.logprob_ids is not None:
            result.set_logprobs(hosts[0], hosts[1], hosts[2])
        base = 3 if out.logprob_ids is not None else 0
        for i, p in enumerate(prompt_lps):
            ids, values, ranks = hosts[base + 3 * i : base + 3 * i + 3]
            result.add_prompt_logprobs(p.req_id, p.first_position, ids, values, ranks)
        if copy_drafts and self.speculator is not None:
            result.set_drafts(hosts[-1 - num_pooled])
        if pooled is not None:
            result.set_pooled(pooled[0], hosts[len(hosts) - num_pooled:])
        return result

    def _proposed_drafts(self, batch: InputBatch) -> torch.Tensor:
        """``[num_reqs, k]`` on the device: the drafts the speculator wrote past each
        request's known tokens (a request that sampled nothing: whatever its row holds
        there, not read)."""
        rows = batch.idx_mapping[: batch.num_reqs].long()
        width = self.table.token_ids.shape[1]
        cols = self.table.num_tokens[rows].long()[:, None] + self._draft_offsets
        return self.table.token_ids[rows[:, None], cols.clamp(max=width - 1)]

    # -- start-up ----------------------------------------------------------------------------

    def capture_graphs(self, capture: Callable[[InputBatch, Callable[[], Any]], object]) -> None:
        """Capture the mixed graphs (``max_mixed_graph_tokens``; when the ModelState and the
        attention backends allow them), the uniform-decode graphs (``1`` and ``1 + k`` tokens
        per request, every padded size), their sampling tails (a sampler whose ``capturable``
        accepts its ``graph_plan``) or, for a capturable speculator, its drafting graphs, with
        ``capture`` (the ModelState's; tests pass a stand-in that replays eagerly, to run the
        padded graph path on the CPU). The steps they fit replay them from then on.

        Serving LoRA adapters, every graph twice: with the adapters' kernels, and without
        them for the steps while no live request names an adapter (idle, their launches made
        a 0.6B-parameter model's batch-1 decode step ~45% longer on an H200; BENCHMARKS.md
        2026-12-05).
        Both sets share the pool: one graph replays at a time. A pooling-only model (its LM
        head :class:`~mrv2.layers.embedding.PoolingLogits`) gets the mixed graphs alone: its
        requests end with their prompts, no step decodes."""
        self._graph_capture = capture
        if self.lora is None:
            self.graphs = self._capture_set(capture)
        else:
            with self.lora.forced(True):
                with_lora = self._capture_set(capture)
            with self.lora.forced(False):
                self._lora_graphs = (self._capture_set(capture), with_lora)
            self.graphs = with_lora
        self.builder.graphs = self.graphs

    def _capture_set(self, capture: Callable[[InputBatch, Callable[[], Any]], object]
                     ) -> StepGraphs:
        return capture_set(self, capture)

    def _max_mixed_graph_tokens(self) -> int:
        return max_mixed_graph_tokens(self)

    def profile_shape(self) -> tuple[int, int]:
        """``(requests, tokens)`` of the largest step: the token budget over as many requests
        as may run, none longer than ``max_model_len`` (one request alone never holds more, and
        its block-table row has no room for more)."""
        num_reqs = min(self.max_num_reqs, self.max_num_tokens)
        return num_reqs, min(self.max_num_tokens, num_reqs * self.max_model_len)

    def _profile_peak_bytes(self) -> int:
        return profile_peak_bytes(self)

    def _fit_max_model_len(self, bytes_per_block: int) -> None:
        """``max_model_len="auto"``: the longest length, at most the bound it was so far, one
        request of which the KV cache holds (:func:`fit_max_model_len`). What was sized
        before the cache (the state table's token columns and block tables, the input
        buffers, the profiling step) keeps the bound's size: larger than needed, never
        short."""
        bound = self.max_model_len
        if bytes_per_block:  # (else no KV cache layer: the blocks are bookkeeping, any fits)
            lookahead = self.speculator.num_lookahead_tokens if self.speculator else 0
            self.max_model_len = fit_max_model_len(
                self.config, self.num_kv_blocks, self.block_size, self.kv_table_windows,
                self.num_speculative_tokens, lookahead, bound, self.device)
            self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.startup.auto_max_model_len(self.max_model_len, bound, self.num_kv_blocks,
                                        self.block_size, bytes_per_block)
