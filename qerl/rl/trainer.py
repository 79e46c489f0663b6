"""The RL loop: rollout (with AQN) -> score -> GRPO/DAPO update of LoRA on the frozen quantized base.

`Trainer.train_step` is the step, its phases called in order in that one method. Each phase is a plain method over
plain data (`RolloutBatch`): the Prefect flow runs them as tasks by wrapping them from outside (`qerl.tasks.training`),
so nothing here knows about Prefect.
Checkpoints hold everything a resumed run needs to continue bit for bit on the CPU: adapter, optimizer, scheduler,
RNG states, step and data position.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from qerl.config import Settings
from qerl.data import problems as data
from qerl.data import rewards
from qerl.data.prompt_length import fit_prompts, model_context
from qerl.errors import naming_a_full_disk
from qerl.execution import ExecutionPlan, attach
from qerl.model import lora
from qerl.model.aqn import build_schedule
from qerl.model.served import own_model_settings, vllm_options
from qerl.model.runtime import (check_module_names, load_base_model, load_tokenizer_and_context, pin_cpu_threads,
                                resolve_device, seed_everything)
from qerl.quant.linear import fp8_available
from qerl.rl import distributed, grpo, precompile, state_check, stopping
from qerl.rl.logprobs import PolicyLogProbs
from qerl.rl.memory import StepPeaks, return_large_frees_to_the_os
from qerl.rl.metrics import speculation_metrics, step_metrics
from qerl.rl.optim import build_optimizer
from qerl.rl.batch import RolloutBatch
from qerl.rl.rng import restore_rng, rng_state
from qerl.rl.reward_calls import RewardCalls, RewardFailed, TrainerState
from qerl.rl.scoring import PromptView, Scorer
from qerl.rl.tracking import NullTracker, Tracker, log_step
from qerl.rl.update import PolicyUpdate
from qerl.rollout.backends import RolloutBackend, Sampling
from qerl.rollout.drafts import DraftHistory
from qerl.rollout.factory import engine_options, make_backend
from qerl.rollout.multi_turn import tool_use_of
from qerl.run.checkpoints import PICKLED_STATE, CheckpointCorrupt
from qerl.run.folder import STATE_FILE, Checkpoint, RunFolder

log = logging.getLogger(__name__)

STATE_KEYS = ("step", "optimizer", "scheduler", "sampler", "rng")  # what a checkpoint's state must hold


class Trainer:
    """GRPO/DAPO with LoRA on a quantized base and adaptive quantization noise: a recipe wiring components.

    Set-up (`_start`, in the order a failure is cheapest to report): the training prompts (`data.PromptSampler`),
    the scorer (`scoring.Scorer`: the reward mix, checked against the data), the model and its LoRA parameters, the
    optimizer and its schedule (`optim`), the AQN schedule, the sampler (`rollout.backends`), the step's memory peaks (`memory.StepPeaks`), the loss and the
    update (`update.PolicyUpdate`), then the state of a run to resume. A step is `train_step()`: `rollout()` ->
    `score()` (DAPO: `keep_informative()`, more rounds of both) -> `update()`, then the metrics logged and a
    checkpoint when due. `train()` runs the steps, `evaluate()` between them where due and `export()` at the end.
    An orchestrator changes how a phase runs by wrapping the method on its trainer (the Prefect flow runs each as a
    task: `qerl.tasks.training.run_phases_as_tasks`); the step itself stays here.
    Its run folder (`qerl.run.folder.RunFolder`, opened on `out_dir`) keeps the state: the trainer asks it for the
    checkpoint to resume and hands it the states to save. The folder is locked from construction until `close()`
    (or the end of a `with` block, or the process): a second trainer on the same folder fails at once.
    """

    def __init__(self, settings: Settings, out_dir: str | Path, tracker: Tracker | None = None, resume: bool = False,
                 model=None, tokenizer=None, progress: bool = True, overwrite: bool = False,
                 rollout_backend: RolloutBackend | None = None):
        # Under torchrun, rank 0 holds the folder for the whole job (the other ranks write nothing there).
        self.run = RunFolder(out_dir, resume=resume, overwrite=overwrite, main=distributed.current().is_main)
        self.out = self.run.path
        self._kernels: precompile.Precompile | None = None  # precompile workers, from the start to its end
        try:
            self._start(settings, tracker, model, tokenizer, progress, rollout_backend)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the run folder, and stop kernel precompile workers a failed start left running (idempotent)."""
        kernels, self._kernels = self._kernels, None
        if kernels is not None:
            kernels.stop()
        scorer = getattr(self, "scorer", None)
        if scorer is not None:  # its async rewards' event loop
            scorer.close()
        self.run.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ set-up

    def _start(self, settings: Settings, tracker: Tracker | None, model, tokenizer, progress: bool,
               rollout_backend: RolloutBackend | None) -> None:
        """The run's components, wired in the order a failure is cheapest to report: settings and data before any
        weights load, then the model, what the update trains with, the sampler, and last the state of a run to
        resume."""
        # The thread count in use is part of the run's settings: params.yaml, checkpoints and MLflow record it
        self.settings = s = own_model_settings(replace(settings, model=pin_cpu_threads(settings.model)))
        self.tracker = tracker or NullTracker()
        self.progress = progress
        self.dist = distributed.current()  # under torchrun: this rank's share of each step; else one process
        seed_everything(s.train.seed)
        self.dist.shard(range(s.rollout.prompts_per_step))  # fail now, not at step 1, if the prompts do not split
        if s.rollout.overprovision > 0 and self.dist.active:  # each rank would cut its own share: not one run's
            raise ValueError(f"rollout.overprovision = {s.rollout.overprovision}: not over {self.dist.world_size} "
                             "processes (each rank's rollout would stop on its own groups, so the ranks would not "
                             "train what one process does); set it to 0 or run one process")

        self.system_prompt = s.data.system_prompt if s.data.system_prompt is not None else data.SYSTEM_PROMPT
        self.tool_use = tool_use_of(s.rollout)  # before any weights load: a tool that does not import fails now
        tokenizer, examples = self._training_prompts(model, tokenizer)
        # A rollout draws rollout.prompts_drawn prompts (prompts_per_step, more with rollout.overprovision: the extra
        # ones are consumed with the rest, kept or not, so the data order is the sampler's, checkpointed as before)
        self.sampler = data.PromptSampler(examples, batch_size=s.rollout.prompts_drawn, seed=s.train.seed)
        self.scorer = self._scorer(examples, tokenizer)  # a reward asking for a column the data lacks fails here
        # With model.precompile_kernels the GPU kernels compile in worker processes while the weights load
        self._kernels = self._precompile(s, model, tokenizer) if self.dist.world_size == 1 else None
        if model is None:
            model, tokenizer = load_base_model(s.model, s.quant, s.execution, s.rollout)
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        # How the model runs, every speed switch of the params (also a model passed in): the update reads it there
        self.plan = attach(model, ExecutionPlan.from_settings(s.model, s.execution, self.device, s.quant,
                                                              s.rollout)).plan
        if self.device.type == "cpu":  # the training step's activations live in host memory
            return_large_frees_to_the_os()

        # The adapter trains in fp32 on the CPU and bf16 on CUDA, the dtype of the model's own activations.
        self.params = lora.apply_lora(model, s.lora, dtype=next(model.parameters()).dtype)
        self.dist.broadcast(self.params)
        self.optimizer, self.scheduler = build_optimizer(self.params, s.optim, s.train.steps)
        self.aqn = build_schedule(s.aqn, s.train.steps)  # None when AQN is off: sigma() is then 0
        # The one sampler of this run (and of evaluations of this model): `rollout.backend`, built next to the model.
        self.rollout_backend = rollout_backend or make_backend(
            model, tokenizer, s.rollout.backend, **engine_options(s.rollout),
            vllm=lambda: vllm_options(s, model_context(model)))
        # Speculative rollouts draft from the run's earlier completions of each prompt: kept in the checkpoint, so a
        # resumed run drafts (and so samples) what the uninterrupted one did.
        self.draft_history = DraftHistory()
        # AQN's norms (aqn.include_final_norm, include_qk_norm); it also perturbs the training forward when
        # aqn.in_training_forward
        self.noise = self.rollout_backend.aim_noise(s.aqn.include_final_norm, s.aqn.include_qk_norm)
        self.peaks = StepPeaks(self.device)
        self.loss_cfg = grpo.LossConfig.from_settings(replace(s.grpo, correction=self._correction()),
                                                      max_completion_length=s.rollout.max_new_tokens)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        logprobs = PolicyLogProbs.from_plan(model, s.rollout.temperature, lora_dropout=s.lora.dropout > 0,
                                            beta=s.grpo.beta)
        self.policy_update = PolicyUpdate(model, self.params, self.optimizer, logprobs, self.loss_cfg, s.grpo,
                                          s.optim.max_grad_norm, self.dist, self.noise, self.pad_id)

        self.step = 0
        self.last_checkpoint: Path | None = None  # named when a reward fails a step: where --resume continues
        self._resume()
        if self._kernels is not None:
            self._kernels.wait()
            self._kernels = None
        self.run.write_params(s.to_yaml())
        if self.dist.is_main:
            self.tracker.log_params(s.to_flat_dict())

    def _prompt(self, question: str) -> str:
        """A question as the policy reads it: the chat template with the system prompt (and the tools' schemas
        where the template writes them)."""
        tools = list(self.tool_use.tools.values()) if self.tool_use is not None else ()
        return data.build_prompt(self.tokenizer, question, self.system_prompt, tools=tools)

    def _training_prompts(self, model, tokenizer) -> tuple[object, list[data.Example]]:
        """(tokenizer, the training examples whose prompts fit the model's context). Without a model, only its
        tokenizer and context length load (a second or two), so a bad dataset or LoRA target fails before the
        weights do."""
        s = self.settings
        d = s.data
        examples = data.examples_for(d, key="data.n")
        if model is None:
            tokenizer, context = load_tokenizer_and_context(s.model, s.quant)
        else:
            context = model_context(model)
        examples = fit_prompts(examples, tokenizer, self.system_prompt, context, s.rollout.max_new_tokens,
                               source=d.path or d.name, setting="rollout.max_new_tokens", policy=d.overlong_prompts)
        if s.rollout.prompts_per_step > len(examples):  # bounded by the data, before the model loads
            raise ValueError(f"rollout.prompts_per_step = {s.rollout.prompts_per_step}: more than the "
                             f"{len(examples)} training prompts of {d.path or d.name} (data.n = {d.n}): a step would "
                             f"repeat prompts; set it to {len(examples)} or fewer")
        if s.rollout.prompts_drawn > len(examples):
            raise ValueError(f"rollout.overprovision = {s.rollout.overprovision}: a rollout would draw "
                             f"{s.rollout.prompts_drawn} prompts, more than the {len(examples)} training prompts of "
                             f"{d.path or d.name} (data.n = {d.n}), repeating some; lower it")
        if model is None:
            check_module_names(s)  # from the config: a typo fails now, not after the weights load
        return tokenizer, examples

    def _scorer(self, examples: list[data.Example], tokenizer) -> Scorer:
        """The reward mix of `train.rewards` (qerl.rl.reward_calls) and the environment's own reward where it scores,
        checked against the data's columns before the weights load: a TRL-form function asking for a column the
        data lacks fails now, not at step 1."""
        t = self.settings.train
        terms = rewards.reward_terms(dict(t.rewards), dict(t.reward_forms))
        own = self.tool_use.environment_reward() if self.tool_use is not None else None
        if own is not None:  # an environment that scores is a reward source of its own, weight 1 (as in TRL)
            name, fn = own
            terms.append(rewards.RewardTerm(self.settings.rollout.environment, fn, 1.0, "trl", name))
        calls = RewardCalls(terms, t.reward_timeout_s)
        calls.check_arguments(list(examples[0].columns) if examples else [],
                              environments=self.tool_use is not None and self.tool_use.environment is not None)
        return Scorer(calls, PromptView.for_format(t.reward_format, tokenizer, self.system_prompt))

    def _resume(self) -> None:
        """Continue from the run folder's newest intact checkpoint, if it has one (`--resume`). Rank 0 resolves
        damaged checkpoints (it moves them aside) before the other ranks read the same folder."""
        s = self.settings
        resumed = self.run.checkpoint_to_resume(s.to_dict(), STATE_KEYS, self.check_checkpoint) \
            if self.dist.is_main else None
        self.dist.barrier()
        if not self.dist.is_main:
            resumed = self.run.checkpoint_to_resume(s.to_dict(), STATE_KEYS, self.check_checkpoint)
        if resumed is not None:
            self.apply_checkpoint(resumed)

    def _precompile(self, s: Settings, model, tokenizer):
        """Start compiling this run's GPU kernels in workers (None where there is nothing to do): from the loaded
        model's config, or before the load from the checkpoint's config.json."""
        device = next(model.parameters()).device if model is not None else resolve_device(s.model.device)
        if device.type != "cuda" or not s.model.precompile_kernels or tokenizer is None:
            return None
        if model is not None:
            config = model.config
        else:
            from qerl.model.loading import read_config, resolve_model
            from qerl.model.transformer import ModelConfig

            folder = resolve_model(s.quant.quantized_path or s.model.path)
            if not (folder / "config.json").is_file():  # a .gguf: its config comes with its weights
                return None
            config = ModelConfig.from_hf(read_config(folder))
        # The first step's prompts (a copy of the sampler draws them): the prompt length sets some kernels' variants
        prompts = [data.build_prompt(tokenizer, ex.question, self.system_prompt)
                   for ex in copy.deepcopy(self.sampler).next_batch()]
        prompt_len = max(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
        return precompile.start(s, config, prompt_len, device, loaded=model is not None)

    def _correction(self) -> str:
        """grpo.correction with `auto` resolved: tis where the rollouts and the update compute in different
        precisions (RolloutBackend.reduced_precision, or the FP8 update), none elsewhere; said in one line when it
        turns tis on."""
        g = self.settings.grpo
        if g.correction != "auto":
            return g.correction
        paths = self.rollout_backend.reduced_precision()
        # The update in FP8 (where FP8 tensor cores are; elsewhere update_precision runs it bf16), the rollouts not:
        # 0.035 nats/token (BENCHMARKS.md, 2026-11-27)
        if self.plan.base_gemm == "fp8" and fp8_available(self.device):
            paths.append("bf16 GEMMs beside the FP8 update (model.base_gemm)")
        if paths and g.tis_cap is None:
            cap = g.correction_cap or grpo.DEFAULT_CORRECTION_CAP
            log.info("grpo.correction auto: tis at cap %s, since the rollouts run on %s (log-prob gap to the update "
                     "over 0.03 nats/token; set grpo.correction to choose)", cap, " and ".join(paths))
        return "tis" if paths else "none"

    # ------------------------------------------------------------------------------------------------ the step

    def train_step(self) -> dict[str, float]:
        """One training step, its phases in order; returns the step's metrics. A new phase (e.g. a pass of the
        reference's log-probs) is one more line here, a method over the `RolloutBatch`."""
        batch = self.score(self.rollout())
        if self.settings.grpo.dynamic_sampling:  # DAPO: more rounds, until enough groups carry a learning signal
            batch = self.keep_informative(batch)
        metrics = self.update(batch)
        self.log_metrics(metrics)
        if self.dist.is_main and (self.step % self.settings.train.save_every == 0
                                  or self.step == self.settings.train.steps):
            self.save_checkpoint()
        return metrics

    # ------------------------------------------------------------------------------------------------ phases

    def sigma(self, step: int | None = None) -> float:
        return self.aqn.sigma(self.step if step is None else step) if self.aqn else 0.0

    def _seed(self, *parts: int) -> int:
        """A seed that depends only on the run seed and the position in the run, so resuming replays it exactly."""
        return hash((self.settings.train.seed,) + parts) % (2**31)

    def rollout(self, examples: list[data.Example] | None = None, round_: int = 0) -> RolloutBatch:
        """Sample `group_size` completions per prompt with AQN noise in the norm weights (removed afterwards).
        Without `examples`, the sampler's next prompts: with rollout.overprovision, `prompts_drawn` of them, of
        which the `prompts_per_step` groups that finish first are kept (the others are cut and dropped)."""
        r = self.settings.rollout
        # With over-provisioning, the rollout stops once this many groups are finished (None: every row runs out)
        needed = r.prompts_per_step if examples is None and r.prompts_drawn > r.prompts_per_step else None
        examples = examples if examples is not None else self.sampler.next_batch()
        first, examples = self.dist.shard(examples)  # every rank draws the step's prompts and keeps its groups
        prompts = [self._prompt(ex.question) for ex in examples]
        prompts = [p for p in prompts for _ in range(r.group_size)]
        # Each completion's randomness comes from its place in the step, not its batch: N ranks sample what one does.
        row_seeds = [self._seed(self.step, round_, 2, first + i, j) for i in range(len(examples))
                     for j in range(r.group_size)]
        sigma, noise_seed = self.sigma(), self._seed(self.settings.aqn.seed, self.step, 1)
        sampling = Sampling(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                            stop_strings=tuple(r.stop_strings), row_seeds=tuple(row_seeds), groups_needed=needed,
                            group_size=r.group_size)
        start = time.perf_counter()
        self.peaks.start_phase()
        counts = self.rollout_backend.speculation_counts()
        with self.rollout_backend.sync(sigma, noise_seed):
            out, tool_counts = self._sample(prompts, sampling, [ex.columns for ex in examples
                                                                for _ in range(r.group_size)])
        # The rollout's peak with its KV cache mapped; then the update gets that memory (graphs kept) and its own
        # peak is measured from here.
        self.peaks.rollout_done()
        if self.plan.release_kv_cache:
            self.rollout_backend.sleep()
        self.peaks.start_phase()
        seconds = time.perf_counter() - start
        if self.progress:  # a step's first sign of life; its summary comes after the update
            log.info("step %d/%d: sampled %d completions (%d tokens) in %.1fs", self.step + 1,
                     self.settings.train.steps, len(prompts), sum(map(len, out.completion_ids)), seconds)
        extra = speculation_metrics(counts, self.rollout_backend.speculation_counts(),
                                    sum(map(len, out.completion_ids)))
        extra.update({f"rollout/{k}": v for k, v in tool_counts.items()})
        examples = list(examples)
        if needed is not None:
            examples, out, dropped = self._finished_groups(examples, out, needed)
            extra.update(dropped)
        return RolloutBatch(examples=examples, group_size=r.group_size, samples=out, sigma=sigma,
                            noise_seed=noise_seed, seconds=seconds, extra=extra)

    def _sample(self, prompts: list[str], sampling: Sampling, rows: list) -> tuple[object, dict[str, float]]:
        """The rollout's samples, and its tool calls' counts (multi-turn rollouts, whose environments are reset with
        each prompt's data row in `rows`; {} for single-turn ones)."""
        if self.tool_use is not None:
            return self.rollout_backend.generate_with_tools(prompts, sampling, self.tool_use, rows=rows)
        return self.rollout_backend.generate(prompts, sampling, drafts=self.draft_history,
                                             progress=self.progress and sys.stderr.isatty()), {}  # a live bar

    def _finished_groups(self, examples: list[data.Example], out, needed: int):
        """An over-provisioned rollout's kept groups: those without "cut" rows (the sampler kept `needed`; a backend
        that ran every row to its end, the first `needed`), with the metrics of what was dropped."""
        G = self.settings.rollout.group_size
        kept = [g for g in range(len(examples)) if "cut" not in out.stop_reasons[g * G:(g + 1) * G]][:needed]
        rows = [g * G + j for g in kept for j in range(G)]
        chosen = set(rows)
        dropped = {"rollout/groups_dropped": len(examples) - len(kept),
                   "rollout/tokens_dropped": sum(len(c) for i, c in enumerate(out.completion_ids) if i not in chosen)}
        return [examples[g] for g in kept], out.select(rows), dropped

    def score(self, batch: RolloutBatch) -> RolloutBatch:
        """Fill `rewards` (the weighted reward mix) and `accuracy` (the plain grader) of every completion. A reward
        function that fails (`RewardFailed`) fails the step before its update: the run folder keeps its last
        checkpoint, which the message names for --resume. Under torchrun it fails every rank, with the failing rank's
        message (the others would wait for it in the update's collectives)."""
        with self.dist.failing_together(RewardFailed):
            try:
                return self.scorer(batch, TrainerState(global_step=self.step, max_steps=self.settings.train.steps))
            except RewardFailed as e:
                where = (f"fix it and continue from {self.last_checkpoint.name} with --resume"
                         if self.last_checkpoint is not None else "no checkpoint yet: fix it and start the run again")
                raise RewardFailed(f"{e}; {where}") from e.__cause__

    def keep_informative(self, batch: RolloutBatch) -> RolloutBatch:
        """DAPO's dynamic sampling on the step's scored first round `batch`: only the groups whose rewards differ,
        with more rounds (each a `rollout` of new prompts and its `score`) until `prompts_per_step` such groups are
        found or `grpo.max_resample_rounds` ran out; none found leaves a batch without groups (a skipped update)."""
        g = self.settings.grpo
        want, kept, drawn, found = self.settings.rollout.prompts_per_step, [], [], 0
        for round_ in range(g.max_resample_rounds + 1):
            b = batch if round_ == 0 else self.score(self.rollout(round_=round_))
            drawn.append(b)
            informative = grpo.informative_groups(b.rewards, b.group_size).tolist()
            kept.append(b.select_groups([i for i, ok in enumerate(informative) if ok]))
            found += sum(self.dist.gather(informative))  # every rank counts the whole step's groups: one decision
            if found >= want:
                break
        out = self._kept_groups(kept, want)
        out.seconds = sum(b.seconds for b in drawn)
        out.score_seconds = sum(b.score_seconds for b in drawn)
        out.grader_timeouts = sum(b.grader_timeouts for b in drawn)
        kept_groups = int(self.dist.sum([len(out.examples)])[0])
        out.extra.update({"dynamic_sampling/rounds": len(drawn), "dynamic_sampling/kept_groups": kept_groups})
        for key in ("rollout/groups_dropped", "rollout/tokens_dropped"):  # over-provisioning: every round's
            if any(key in b.extra for b in drawn):
                out.extra[key] = sum(b.extra.get(key, 0) for b in drawn)
        return out

    def _kept_groups(self, kept: list[RolloutBatch], want: int) -> RolloutBatch:
        """The step's first `want` kept groups in one-process order (round by round, prompt by prompt), and this
        rank's contiguous share of them. Over several processes the ranks exchange their kept groups (token ids and
        scores: small) so each trains an equal share; when the rounds ran out short of `want`, the groups are cut to
        a multiple of the process count (one process keeps them all; fewer groups than processes: a skipped step)."""
        if not self.dist.active:
            out = RolloutBatch.concat(kept)
            return out.select_groups(list(range(min(want, len(out.examples)))))
        ranks = self.dist.gather([kept])  # [rank][round]
        out = RolloutBatch.concat([ranks[r][i] for i in range(len(kept)) for r in range(self.dist.world_size)])
        total = min(want, len(out.examples))
        total -= total % self.dist.world_size
        first, mine = self.dist.shard(range(total))
        return out.select_groups(list(mine))

    @torch.no_grad()
    def measure_entropy(self, examples: list[data.Example]) -> dict[str, float]:
        """The policy's mean per-token entropy on its own completions to `examples` (`group_size` each), as the
        `entropy` training metric measures it, without updating anything: e.g. a base format's entropy at step 0.
        The rollouts carry this step's AQN noise, as in training; build the trainer with AQN off for the clean policy.
        """
        batch = self.rollout(examples)
        t = batch.padded(self.pad_id)
        was_training = self.model.training
        self.model.eval()
        total = count = 0.0
        mb = self.settings.grpo.micro_batch_size
        for start in range(0, len(batch), mb):
            rows = slice(start, start + mb)
            _, entropy = self.policy_update.logprobs(t["ids"][rows].to(self.device),
                                                     t["attn"][rows].to(self.device), t["P"], want_entropy=True)
            mask = t["mask"][rows].to(self.device)
            total += float((entropy * mask).sum())
            count += float(mask.sum())
        self.model.train(was_training)
        return {"entropy": total / max(count, 1.0), "completions": len(batch), "tokens": int(count)}

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """The policy update on this scored batch (`PolicyUpdate`), the schedules' steps, and the step's metrics.
        A batch without groups (dynamic sampling kept none) ends the step without an update."""
        if not batch.examples:
            # The learning-rate schedule counts updates (as transformers' Trainer steps its scheduler only after an
            # optimizer step that ran): stepping it here, with no optimizer step before, shifted the schedule and
            # had torch warn "lr_scheduler.step() before optimizer.step()" when it was the run's first step.
            self.step += 1
            return {"step": self.step, "skipped": 1.0, "sigma": batch.sigma}
        start = time.perf_counter()
        sigma_train = self.sigma() if self.settings.aqn.in_training_forward else 0.0
        totals, step_rewards, truncated = self.policy_update(batch, sigma_train)
        if totals.nonfinite_skipped < self.settings.grpo.num_iterations:  # the schedule counts updates that ran
            self.scheduler.step()
        self.step += 1
        # Its rollouts' peaks, then scoring's and the update's.
        metrics = step_metrics(self.dist, self.step, batch, step_rewards, truncated, totals,
                               lr=self.scheduler.get_last_lr()[0], seconds_update=time.perf_counter() - start,
                               peak_memory=self.peaks.step_peak())
        if self.aqn is not None:  # the entropy-targeted schedule picks the next step's sigma from this one's
            self.aqn.observe(metrics["entropy"])
        return metrics

    # ------------------------------------------------------------------------------------------------ loop

    def train(self, max_steps: int | None = None) -> Path:
        """Run `train_step` until `train.steps` (or `max_steps` more steps), `evaluate` every `train.eval_every`;
        `export` and return the final adapter folder. SIGTERM or SIGINT meanwhile: the step in progress finishes, a
        checkpoint is written and `qerl.rl.stopping.TrainingStopped` raised."""
        total, eval_every = self.settings.train.steps, self.settings.train.eval_every
        stop = total if max_steps is None else min(total, self.step + max_steps)
        log.info("training %s -> step %d of %d in %s", self.settings.model.path, stop, total, self.out)
        with stopping.StopSignals() as signals:
            stopped_by = 0

            def stop_requested() -> bool:  # every rank takes the same decision, whichever rank the signal reached
                nonlocal stopped_by
                stopped_by = int(self.dist.max([float(signals.signum or 0)])[0])
                return stopped_by > 0

            while self.step < stop:
                self.train_step()
                if stop_requested():
                    break
                if eval_every and self.step % eval_every == 0 and self.step < stop:
                    self.evaluate()
                    if stop_requested():
                        break
            if self.step < total and self.step % self.settings.train.save_every and self.dist.is_main:
                self.save_checkpoint()  # stopped early: --resume continues from here, not from the last save
        if stopped_by and self.step < stop:  # (a signal in the last step asked for: the run ends as it would have)
            raise stopping.TrainingStopped(stopped_by, self.step, total, self.run.checkpoint_path(self.step),
                                           steps_left=stop - self.step)
        adapter = self.out / "adapter"
        if self.dist.is_main:
            adapter = self.export()
        self.dist.barrier()  # every rank returns once the run's outputs exist
        return adapter

    def evaluate(self) -> None:
        """An evaluation due after this step (every `train.eval_every` steps, the run's last step excepted: what
        follows training evaluates that one). None here: `qerl train` trains only; the training flow replaces this
        method on its trainer with its `evaluate` task (qerl.flows.train)."""

    def export(self) -> Path:
        """The run's outputs once the loop is done (rank 0 only): the final adapter folder and the plots."""
        adapter = self.export_adapter(self.out / "adapter")
        self.write_plots()
        return adapter

    def log_metrics(self, metrics: dict[str, float]) -> None:
        if not self.dist.is_main:  # the metrics are already the whole step's: one rank writes them
            return
        self.run.metrics.write(metrics)
        log_step(self.tracker, metrics)
        if self.progress:
            keys = ("reward_mean", "accuracy", "entropy", "clip_ratio/region", "response_length", "sigma",
                    "rollout_tokens_per_s", "seconds_rollout", "seconds_update")
            shown = " ".join(f"{k.split('/')[0]}={metrics[k]:.4g}" for k in keys if k in metrics)
            if metrics.get("grader_timeouts"):  # scored 0 only because math-verify went over its CPU budget
                shown += f" grader_timeouts={metrics['grader_timeouts']}"
            log.info("step %d/%d %s", metrics["step"], self.settings.train.steps, shown)

    def write_plots(self) -> list[Path]:
        from qerl.rl.plots import plot_training_curves

        with naming_a_full_disk(self.out):
            return plot_training_curves(self.run.metrics.read(), self.out)

    # ------------------------------------------------------------------------------------------------ state

    def export_adapter(self, out_dir: str | Path) -> Path:
        base = str(self.settings.quant.quantized_path or self.settings.model.path)
        with naming_a_full_disk(out_dir):
            return lora.save_adapter(self.model, out_dir, base, self.settings.lora, self.settings.quant.base_record())

    def save_checkpoint(self, keep: int = 2) -> Path:
        """Adapter + optimizer + scheduler + RNG + data position, handed to the run folder (atomic, with a manifest);
        its `keep` newest stay."""
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "aqn": self.aqn.state_dict() if self.aqn is not None else {},
            "rng": rng_state(),
            "settings": self.settings.to_dict(),
        }
        if len(self.draft_history):  # speculation's history; none without it (the checkpoint as before)
            state["drafts"] = self.draft_history.state_dict()
        self.last_checkpoint = self.run.save_checkpoint(state, lambda folder: self.export_adapter(folder / "adapter"),
                                                        keep=keep)
        return self.last_checkpoint

    def check_checkpoint(self, checkpoint: Checkpoint) -> None:
        """`CheckpointCorrupt` naming the file if `apply_checkpoint` could not continue from `checkpoint` (its state
        does not fit this trainer: `qerl.rl.state_check`, or its adapter does not fit the model); changes nothing."""
        problem = state_check.first_problem(checkpoint.state, self.optimizer, self.sampler)
        if problem:  # the state was read from the JSON file, or from an older qerl's pickle in its place
            file = STATE_FILE if (checkpoint.path / STATE_FILE).is_file() else PICKLED_STATE
            raise CheckpointCorrupt(f"{checkpoint.path / file}: {problem}")
        try:
            lora.check_adapter(self.model, checkpoint.path / "adapter")
        except (ValueError, OSError) as e:  # the message names the adapter's file
            raise CheckpointCorrupt(" ".join(str(e).split())) from None

    def apply_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Continue from `checkpoint` (the run folder's `checkpoint_to_resume`): adapter, optimizer, scheduler, data
        position, AQN schedule, RNG states and step."""
        state = checkpoint.state
        lora.load_adapter(self.model, checkpoint.path / "adapter")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        if self.aqn is not None:
            self.aqn.load_state_dict(state.get("aqn", {}))  # older checkpoints: geometric only, which keeps no state
        restore_rng(state["rng"])
        if "drafts" in state:  # older checkpoints hold none: speculation drafts from this step's rows then
            self.draft_history.load_state_dict(state["drafts"])
        self.step = checkpoint.step
        self.last_checkpoint = checkpoint.path
