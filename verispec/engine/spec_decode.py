"""The speculative decode step: propose, verify, accept, commit (docs/design.md §3, §5, §8).

One step for a batch of running requests:

1. each request gets ``max_num_draft_tokens`` = k cut by ``max_model_len`` and its remaining
   ``max_tokens`` (and by the per-request switch below); the proposer drafts ``n_r`` tokens;
2. one target forward over ``[last committed token, d_1 .. d_{n_r}]`` of every request returns
   the ``n_r + 1`` rows of each in the flattened layout of docs/design.md §2;
3. the rejection sampler keeps the accepted drafts and adds the recovered or bonus token;
4. the engine commits the output tokens in order (a stop inside an accepted run ends the request
   there), rolls the target cache back to the committed tokens, and the proposer rolls its own.

How many drafts each request gets (the cost of verifying n drafts, each request's acceptance
estimate, switching speculation off where it does not pay) is ``engine.draft_planner``'s: this
step asks it for n and tells it what was accepted. Synthetic mode never switches off: the user
asked for a given acceptance.

A step in which no request drafted (the n-gram found no match, or every request is switched off)
is a plain decode step: one row per request through the plain sampler. Its tokens are the ones
the rejection sampler would emit as bonus tokens (same stream, same position: docs/design.md §4), so
this changes cost, never output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from verispec import ops
from verispec.config import SpeculativeConfig
from verispec.engine.draft_planner import DraftPlanner, measured_costs, verify_costs
from verispec.engine.metrics import SpecDecodingLogger, SpecDecodingStats
from verispec.engine.request import Request
from verispec.models.parallel import SINGLE, TensorParallel
from verispec.ops import tree_rejection as ops_tree_rejection
from verispec.ops.staging import HostDrafts
from verispec.proposers import ProposerContext, build_proposer
from verispec.runtime.model_runner import ModelRunner
from verispec.runtime.tree_verify import commit_tree_path, keep_path_hidden, verify_tree
from verispec.sample.options import SamplingOptions
from verispec.sample.rejection_sampler import RejectionSampler
from verispec.sample.sampler import Sampler, SamplingTensors

logger = logging.getLogger("verispec")

def check_tree_support(runner: ModelRunner, proposer, tp: TensorParallel) -> None:
    """ValueError where token trees do not run yet (docs/design.md §16): an attention-only
    target (either layout) with a draft model or an EAGLE head, one process; a dynamic tree
    with an EAGLE head only."""
    key = proposer.config.tree_key
    if runner.hybrid:
        raise ValueError(f"{key}: token trees need an attention-only target: a hybrid "
                         "model's recurrent state cannot branch")
    if tp.size > 1:
        raise ValueError(f"{key}: token trees do not run with tensor parallelism yet")
    if not hasattr(proposer, "propose_tree") or getattr(proposer.runner, "hybrid", False):
        raise ValueError(f"{key}: only an attention-only draft model or an EAGLE head "
                         "drafts token trees")
    if proposer.config.speculative_eagle_topk is not None and not getattr(
            proposer, "drafts_dynamic_trees", False):
        raise ValueError("speculative_eagle_topk: only an EAGLE head drafts dynamic trees")


class SpeculativeDecoder:
    """Owns the proposer, the rejection sampler and the speculative metrics of an engine."""

    def __init__(
        self,
        config: SpeculativeConfig,
        runner: ModelRunner,
        vocab_size: int,
        max_num_seqs: int,
        max_model_len: int,
        tokenizer=None,
        log_interval_s: float = 5.0,
        tp: TensorParallel = SINGLE,
        options: SamplingOptions | None = None,
        load_format: str = "auto",
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.runner = runner
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self._host_outputs: torch.Tensor | None = None  # pinned copy of a step's output tokens
        self._outputs_copied = None
        context = ProposerContext(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            device=runner.device,
            dtype=runner.dtype,
            target_model=runner,
            tokenizer=tokenizer,
            block_tables=runner.kv_cache.block_tables,
            tp=tp,
            load_format=load_format,
        )
        self.proposer = build_proposer(config, context)
        self.rejection_sampler = RejectionSampler(config, runner.device)
        self.vocab_size = vocab_size
        self.sampler = Sampler()  # steps in which nobody drafted
        # The requests' logits options, applied to every row before the (rejection) sampler
        self.options = options or SamplingOptions(max_num_seqs, vocab_size, runner.device)
        self.adaptive = not config.is_synthetic
        # n drafts cost the verify forward plus n of the proposer's own forwards
        draft_cost = self.proposer.draft_cost
        self.costs = tuple(cost + n * draft_cost for n, cost in
                           enumerate(verify_costs(runner.device, runner.dtype, self.k)))
        self.logger = SpecDecodingLogger(self.k, log_interval_s)
        # Wall time spent proposing and verifying, for reports only (never for decisions).
        self.propose_time_s = 0.0
        self.verify_time_s = 0.0
        self.num_steps = 0
        # The target logits of the last step and the first row of each request in them
        # (``[sum(n_r + 1), V]``, docs/design.md §2): output token j of request r came from row
        # ``first_rows[r] + j``. Read by the engine right after the step, for logprobs.
        self.step_logits: tuple[torch.Tensor, np.ndarray] | None = None
        self.planner = DraftPlanner(max_num_seqs)  # each slot's acceptance estimate
        # A static or a dynamic token tree (docs/design.md §16), None for chains
        self.tree = config.tree_shape()
        if self.tree is not None:
            check_tree_support(runner, self.proposer, tp)
            # a tree cut to depth d: the verify forward over its nodes and root, d levels drafted
            verify = verify_costs(runner.device, runner.dtype, self.tree.num_nodes_total)
            self.tree_costs = tuple(verify[self.tree.num_nodes(d)] + d * draft_cost
                                    for d in range(self.tree.depth + 1))

    @property
    def max_step_drafts(self) -> int:
        """The most draft tokens one request verifies in a step: k, or a tree's nodes."""
        return self.k if self.tree is None else self.tree.num_nodes_total

    def capture(self) -> None:
        """Capture the proposer's draft graphs (the target's verify graph is the engine's) and
        measure the step costs from the graphs (no-op without CUDA graphs)."""
        self.proposer.capture()
        draft_runner = self.proposer.runner
        if (draft_runner is not None and draft_runner.graphs is not None
                and draft_runner.graphs is not self.runner.graphs):
            draft_runner.graphs.log_summary("draft")
        costs = measured_costs(self.runner, self.proposer, self.k)
        if costs is not None:
            self.costs = costs
            logger.info("speculative step cost measured on the device: %.2f decode steps",
                        costs[-1])

    def warm_up(self, sampling: SamplingTensors, positions: torch.Tensor) -> None:
        """Verify a dummy batch (``len(positions)`` requests of k drafts each, the proposer's
        rule) once, so the rejection sampler's kernels and launch plan for that batch size
        exist before a step needs them (``LLM._warm_up_samplers``)."""
        batch_size, device = positions.shape[0], self.runner.device
        num_drafts = batch_size * self.k
        vocab_size = self.vocab_size
        logits = torch.zeros((num_drafts + batch_size, vocab_size), dtype=torch.float32,
                             device=device)
        draft_probs = None
        if self.proposer.uses_draft_probs:
            draft_probs = torch.full((num_drafts, vocab_size), 1.0 / vocab_size,
                                     dtype=torch.float32, device=device)
        self.rejection_sampler(
            logits, torch.zeros(num_drafts, dtype=torch.int64, device=device),
            ops.to_device(np.arange(0, num_drafts + 1, self.k), device), draft_probs,
            sampling, positions)

    @property
    def stats(self) -> SpecDecodingStats:
        """Totals over every step so far."""
        return self.logger.total

    def admit(self, request: Request) -> None:
        """A request took a slot: start its acceptance estimate and its stats, or, for a
        request preempted earlier, restore them (its draft plan, hence its tokens, go on as if
        it had never left)."""
        self.planner.start(request.slot, getattr(request, "spec_plan_state", None))
        request.spec_plan_state = None
        if request.spec_stats is None:
            request.spec_stats = SpecDecodingStats(self.k)

    def release(self, request: Request, preempted: bool = False) -> None:
        """A request left its slot (``preempted``: it will be recomputed; keep its plan)."""
        slot = request.slot
        if preempted:
            request.spec_plan_state = self.planner.state(slot)
        self.proposer.free(slot)

    def _plan(self, batch: Sequence[Request]) -> None:
        """Set each request's ``max_num_draft_tokens`` for this step."""
        for r in batch:
            room = min(self.k, self.max_model_len - r.num_tokens - 1,
                       r.params.max_tokens - r.num_output_tokens - 1)
            n = max(0, room)
            if self.adaptive and n > 0:
                n = self.planner.plan(r.slot, n, self.costs)
            r.max_num_draft_tokens = n

    def step(self, batch: Sequence[Request], sampling: SamplingTensors) -> list[list[int]]:
        """Propose, verify and accept for ``batch``; returns each request's output tokens (to be
        committed by the engine, then ``on_committed``)."""
        if self.tree is not None:
            return self._tree_step(batch, sampling)
        self._plan(batch)
        start = time.perf_counter()
        self.options.sync_grammars(batch)  # proposers draft under the grammar (§15)
        proposal = self.proposer.propose(batch)
        num_drafts = proposal.num_draft_tokens_cpu  # [B] host
        if not num_drafts.any():
            return self._plain_step(batch, sampling, start)
        proposed = time.perf_counter()
        # The drafts stay on the device: the verify forward scatters them into its inputs.
        penalties = self.options.step_penalties(batch)
        host_drafts = self.options.fetch_drafts(batch, proposal.draft_token_ids)
        target_logits = self.runner.verify([r.slot for r in batch],
                                           [r.last_token_id for r in batch],
                                           proposal.draft_token_ids, num_drafts, penalties)
        # Row i of a request sees its drafts d_1..d_i (penalties, min_tokens, bad_words, the
        # grammar's mask, built on the host while the GPU verifies): the distribution a plain
        # step would use there (docs/design.md §15).
        target_logits = self.options.process(target_logits, batch, num_drafts,
                                             proposal.draft_token_ids, penalties, host_drafts)
        first_rows = np.concatenate([[0], np.cumsum(num_drafts + 1)[:-1]])
        self.step_logits = (target_logits, first_rows)
        # Draft i of request r occupies position num_tokens + i (num_tokens counts the prompt).
        positions = ops.to_device([r.num_tokens for r in batch], self.runner.device)
        token_ids = self._read_outputs(batch, self.rejection_sampler(
            target_logits,
            proposal.draft_token_ids.to(self.runner.device),
            ops.to_device(proposal.cu_num_draft_tokens, self.runner.device),
            proposal.draft_probs,
            sampling,
            positions,
        ))
        self.propose_time_s += proposed - start
        self.verify_time_s += time.perf_counter() - proposed
        self.num_steps += 1
        outputs = [[t for t in row if t != -1] for row in token_ids]
        step_stats = SpecDecodingStats(self.k)
        for r, n, out in zip(batch, num_drafts, outputs):
            n, accepted = int(n), len(out) - 1
            if n > 0:
                step_stats.observe(n, accepted)
                r.spec_stats.observe(n, accepted)
                self.planner.observe(r.slot, n, accepted)
        self.logger.observe(step_stats)
        self.logger.maybe_log()
        return outputs

    def _tree_depths(self, batch: Sequence[Request]) -> np.ndarray:
        """[B] each request's tree depth this step: k cut, as a chain's k, so that the last
        token emitted fits ``max_model_len`` and ``max_tokens``, and further so that the tree's
        rows fit the cache (``num_tokens - 1 + nodes < max_model_len``); then, as a chain's n,
        the depth the request's acceptance estimate makes best for ``tree_costs``: 0 (no tree,
        a plain row) where no tree pays, with the chain's probes (``DraftPlanner``)."""
        tree = self.tree
        depths = np.zeros(len(batch), dtype=np.int64)
        for b, r in enumerate(batch):
            room = min(self.k, self.max_model_len - r.num_tokens - 1,
                       r.params.max_tokens - r.num_output_tokens - 1)
            depth = max(0, min(room, tree.max_depth_within(self.max_model_len - r.num_tokens)))
            if self.adaptive and depth > 0:
                depth = self.planner.plan(r.slot, depth, self.tree_costs)
            depths[b] = depth
        return depths

    def _tree_step(self, batch: Sequence[Request], sampling: SamplingTensors) -> list[list[int]]:
        """A step with token trees (docs/design.md §16): draft each request's tree, verify
        every tree in one target forward (``verify_tree``), walk it with
        ``tree_rejection_sample`` and keep the accepted path's K/V in both caches."""
        tree = self.tree
        start = time.perf_counter()
        depths = self._tree_depths(batch)
        for r, depth in zip(batch, depths):
            r.max_num_draft_tokens = tree.num_nodes(int(depth))
        self.options.sync_grammars(batch)  # proposers draft under the grammar (§16)
        proposal = self.proposer.propose_tree(batch, tree, depths)
        num_drafts = proposal.num_draft_tokens  # [B] host
        if not num_drafts.any():
            return self._plain_step(batch, sampling, start)
        proposed = time.perf_counter()
        slots = [r.slot for r in batch]
        cache = self.runner.kv_cache
        starts = cache.lengths_np[slots].copy()  # num_tokens - 1: the root's row
        drafts_host = proposal.draft_token_ids.cpu()  # the tree's layout is built on the host
        target_logits = verify_tree(self.runner, slots, [r.last_token_id for r in batch],
                                    drafts_host.numpy(), proposal.parent_ids, num_drafts,
                                    tree.depth)
        # A node's row sees the drafts on its path from the root (penalties, min_tokens,
        # bad_words, the grammar's mask): what a plain step would see after accepting them
        # (docs/design.md §15, §16).
        target_logits = self.options.process(target_logits, batch, num_drafts,
                                             proposal.draft_token_ids,
                                             host_drafts=HostDrafts(drafts_host),
                                             parent_ids=proposal.parent_ids)
        device = self.runner.device
        cu = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(num_drafts, out=cu[1:])
        positions = ops.to_device([r.num_tokens for r in batch], device)
        token_ids, accepted_nodes = ops_tree_rejection.tree_rejection_sample(
            target_logits, proposal.draft_token_ids.to(device),
            ops.to_device(proposal.parent_ids, device), ops.to_device(cu, device),
            proposal.draft_probs, sampling.temperature, sampling.top_k, sampling.top_p,
            sampling.min_p, sampling.seeds, positions,
            max_num_draft_tokens=max(1, int(num_drafts.max())), max_depth=tree.depth,
            max_width=tree.max_width, without_replacement=True,
            all_greedy=sampling.all_greedy, check=False, kernels=self.runner.backend.cpu)
        accepted_nodes = accepted_nodes.cpu().numpy()
        commit_tree_path(cache, slots, starts, accepted_nodes)
        keep_path_hidden(self.runner, accepted_nodes)  # what an EAGLE head reads next
        self.proposer.commit_tree(slots, [r.num_tokens for r in batch], accepted_nodes)
        outputs = [[t for t in row if t != -1] for row in token_ids.tolist()]
        # output token j of request r came from the row of its path's slot at depth j
        rows = []
        for b, out in enumerate(outputs):
            root = cu[b] + b
            path = accepted_nodes[b, : len(out) - 1]
            rows.append(np.concatenate([[root], root + 1 + path]))
        first_rows = np.concatenate([[0], np.cumsum([len(x) for x in rows])[:-1]])
        path_rows = ops.to_device(np.concatenate(rows), target_logits.device)
        self.step_logits = (target_logits[path_rows], first_rows)
        self.propose_time_s += proposed - start
        self.verify_time_s += time.perf_counter() - proposed
        self.num_steps += 1
        step_stats = SpecDecodingStats(self.k)
        for r, n, depth, out in zip(batch, num_drafts, depths, outputs):
            if n > 0:
                # drafts counted by depth (the tokens a step could accept), as for a chain
                step_stats.observe(int(depth), len(out) - 1)
                r.spec_stats.observe(int(depth), len(out) - 1)
                self.planner.observe(r.slot, int(depth), len(out) - 1)
        self.logger.observe(step_stats)
        self.logger.maybe_log()
        return outputs

    def _read_outputs(self, batch: Sequence[Request], token_ids: torch.Tensor) -> list[list[int]]:
        """The step's one host sync: ``token_ids`` [B, k + 1] as lists. On CUDA the copy to the
        host is queued first, then the proposer may queue the next step's drafts behind it
        (``Proposer.draft_ahead``), so the device drafts while the host commits this step."""
        if token_ids.device.type != "cuda":
            return token_ids.tolist()
        if self._host_outputs is None or self._host_outputs.dtype != token_ids.dtype:
            self._host_outputs = torch.empty(  # [max_num_seqs, k + 1], pinned
                (self.max_num_seqs, self.k + 1), dtype=token_ids.dtype, pin_memory=True)
            self._outputs_copied = torch.cuda.Event()
        host = self._host_outputs[: token_ids.shape[0]]
        host.copy_(token_ids, non_blocking=True)
        self._outputs_copied.record()
        self.proposer.draft_ahead(batch, token_ids)
        self._outputs_copied.synchronize()
        return host.tolist()

    def _plain_step(self, batch: Sequence[Request], sampling: SamplingTensors,
                    start: float) -> list[list[int]]:
        """Nobody drafted: one decode row per request, sampled as its bonus token would be."""
        proposed = time.perf_counter()
        penalties = self.options.step_penalties(batch)
        logits = self.runner.forward([r.slot for r in batch], [[r.last_token_id] for r in batch],
                                     penalties=penalties)
        logits = self.options.process(logits, batch, penalties=penalties)
        self.step_logits = (logits, np.arange(len(batch)))
        positions = ops.to_device([r.num_tokens for r in batch], self.runner.device)
        token_ids = self.sampler(logits, sampling, positions).tolist()  # the one host sync
        self.propose_time_s += proposed - start
        self.verify_time_s += time.perf_counter() - proposed
        self.num_steps += 1
        return [[t] for t in token_ids]

    def on_prefilled(self, requests: Sequence[Request]) -> None:
        """After a forward of prefill chunks (and the commit of the first token of each request
        whose prefill it completed): the proposer takes what it keeps of the chunks (an EAGLE
        head the target's hidden states: its ``on_commit`` up to the chunk's end); a request
        whose prefill is done starts its draft plan."""
        running = [r for r in requests if not r.finished]
        if running:
            self.proposer.on_commit([r.slot for r in running],
                                    [min(r.num_tokens, r.num_computed_tokens + 1)
                                     for r in running])
        for r in requests:
            if not r.is_prefilling:
                self.admit(r)
            if r.finished:
                self.release(r)

    def on_committed(self, batch: Sequence[Request]) -> None:
        """After the engine committed the step: roll the proposer's cache of each request still
        running back to its committed tokens; free finished ones."""
        running = [r for r in batch if not r.finished]
        if running:
            self.proposer.on_commit([r.slot for r in running], [r.num_tokens for r in running])
        for r in batch:
            if r.finished:
                self.release(r)
