"""`rollout.backend: vllm`: a vLLM engine in the trainer's process, as TRL's colocate mode runs it.

vLLM loads the run's frozen base from a folder it can read (`VLLMOptions.base`: the bf16 source, or the NVFP4
compressed-tensors folder `qerl quantize` writes, which vLLM runs with its Marlin FP4 kernels on Hopper). The trainer
keeps its own model for the update; each rollout samples with the policy's current LoRA:

* the adapter is written from the model's own LoRA tensors (PEFT format, in memory-backed /dev/shm where there is
  one) whenever those tensors changed since the last write (their in-place version counters say so), and handed to
  vLLM as a new LoRA id (`lora_update: new_id`), or under one id reloaded in place (`reload`);
* the RMSNorm weights (AQN's noise and any trained norms) are copied into vLLM's model by name before each
  rollout (in place: its CUDA graphs read the same addresses);
* between rollouts the engine sleeps (level 1: weights to host memory, KV cache dropped), so the update has the
  GPU; the next rollout wakes it.

vLLM's kernels are not the update's: its log-probs differ from the trainer's recomputation, so `reduced_precision`
names it and `grpo.correction: auto` turns truncated importance sampling on (BENCHMARKS.md gives the gap).
vLLM is optional (`pip install "qerl[vllm]"`); choosing this backend without it fails in one line.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl.config import VLLM_INSTALL
from qerl.errors import BrokenExtra, MissingExtra, one_line
from qerl.model.lora import LoraSettings, lora_layers, save_adapter
from qerl.rollout import releasable
from qerl.rollout.backends import RolloutBackend, Sampling
from qerl.rollout.sampling import Rollout, decode_ids, default_eos_ids, encode_prompts

__all__ = ["VLLMOptions", "VLLMBackend", "engine_arguments", "require_vllm"]

def require_vllm():
    """The vllm module; else one line (exit 2): how to install it, or what the import of an installed but broken
    vLLM raised (a build for another torch or CUDA raises anything, an ImportError of its own parts included)."""
    try:
        import vllm
    except ModuleNotFoundError as e:
        if e.name != "vllm":
            raise _broken(e) from e
        raise MissingExtra(f"rollout.backend: vllm needs vLLM, which is not installed here; install it with "
                           f"{VLLM_INSTALL}") from None
    except Exception as e:
        raise _broken(e) from e
    return vllm


def _broken(exc: Exception) -> BrokenExtra:
    return BrokenExtra(f"vLLM failed to import: {type(exc).__name__}: {one_line(exc)} (rollout.backend 'vllm'; "
                       f"reinstall it: {VLLM_INSTALL})")


@dataclass(frozen=True)
class VLLMOptions:
    """What the engine is built with (from `rollout.vllm_*` and the run's model, quant and LoRA settings)."""

    base: Path  # a folder vLLM loads: the run's frozen base, bit for bit
    lora: LoraSettings
    max_model_len: int
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.3  # TRL's colocate default: weights + KV cache, a share of the whole GPU
    lora_update: str = "new_id"  # or "reload" (rollout.vllm_lora_update, checked by qerl.config)
    sleep_level: int = 1  # 0: never sleep; 1: weights to host memory and KV cache dropped between rollouts
    seed: int = 0
    enforce_eager: bool = False
    kv_cache_dtype: str = "model"  # rollout.kv_cache_dtype: the model's dtype, or fp8 (vLLM's own FP8 KV cache)


def engine_arguments(options: VLLMOptions, detokenize: bool) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM` for `options` (`detokenize`: the base folder has tokenizer files)."""
    return dict(model=str(options.base), skip_tokenizer_init=not detokenize, dtype="bfloat16", seed=options.seed,
                enable_lora=True, max_lora_rank=max(8, options.lora.rank), max_loras=1,
                max_model_len=options.max_model_len, max_num_seqs=options.max_num_seqs,
                gpu_memory_utilization=options.gpu_memory_utilization, enable_sleep_mode=options.sleep_level > 0,
                enforce_eager=options.enforce_eager,
                # vLLM's "fp8" is E4M3, scaled per tensor (ours, qerl.execution.kv8, per vector); "auto": the model's
                kv_cache_dtype="fp8" if options.kv_cache_dtype == "fp8" else "auto",
                # log_softmax(logits / temperature) before top-k/top-p: what qerl's samplers return and what the
                # trainer recomputes
                logprobs_mode="processed_logprobs")


class VLLMBackend(RolloutBackend):
    """A colocated `vllm.LLM` sampling with the model's current LoRA and norm weights."""

    name = "vllm"

    def __init__(self, model: nn.Module, tokenizer: Any, options: VLLMOptions):
        require_vllm()
        super().__init__(model, tokenizer)
        self.options = options
        # The engine core in this process (TRL's colocate): its model is reachable for the norm copies, and it
        # shares this process's GPU memory accounting.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if importlib.util.find_spec("flashinfer") is None:  # its sampler is optional; vLLM 0.26 imports it unasked
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        from vllm import LLM

        # Without tokenizer files beside the base (random-weight benchmarks) vLLM takes token ids alone; our own
        # tokenizer decodes the completions either way.
        self._detokenize = any((options.base / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        self.llm = LLM(**engine_arguments(options, self._detokenize))
        self._adapter_dir = Path(tempfile.mkdtemp(prefix="qerl-vllm-lora-",
                                                  dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self._lora_id = 0
        self._lora_version: int | None = None
        self._norms = self._shared_norms()
        self._asleep = False

    # ------------------------------------------------------------------------------------------------ weights
    def _vllm_model(self) -> nn.Module:
        return self.llm.collective_rpc(lambda worker: worker.get_model())[0]  # the nn.Module under its graph wrappers

    def _shared_norms(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(ours, vLLM's) for every norm weight of our model, matched by name (all of them, or an error). Found once:
        both sides keep their parameters (AQN writes ours in place; vLLM's sleep restores its at the same addresses)."""
        ours = {n: p for n, p in self.model.named_parameters() if n.endswith("norm.weight")}
        theirs = dict(self._vllm_model().named_parameters())
        missing = [n for n in ours if n not in theirs]
        if missing:
            raise ValueError(f"vLLM's model of {self.options.base} has no parameter {missing[0]} (and "
                             f"{len(missing) - 1} more): AQN noise and trained norms cannot reach it")
        return [(p, theirs[n]) for n, p in ours.items()]

    def _copy_norms(self) -> None:
        with torch.no_grad():
            for ours, theirs in self._norms:
                theirs.copy_(ours.to(theirs.dtype))

    def _lora_request(self):
        """This rollout's LoRARequest. The adapter is rewritten only when the model's LoRA tensors changed; `reload`
        then loads it into its id's slot here, once. The request generate carries never asks for that itself:
        vLLM 0.26 applies a batch's requests at every engine step, and one with `load_inplace` reloads the adapter
        from its files each time (a 7B rollout of 1,024 tokens took 65 s instead of 9: BENCHMARKS.md)."""
        from vllm.lora.request import LoRARequest

        version = sum(p._version for layer in lora_layers(self.model).values()
                      for p in (layer.lora_A, layer.lora_B))
        path = str(self._adapter_dir / "adapter")
        if version != self._lora_version:
            shutil.rmtree(path, ignore_errors=True)
            save_adapter(self.model, Path(path), str(self.options.base), self.options.lora)
            self._lora_version = version
            if self.options.lora_update == "new_id" or self._lora_id == 0:
                if self._lora_id:
                    self.llm.llm_engine.remove_lora(self._lora_id)
                self._lora_id += 1
            else:
                self.llm.llm_engine.add_lora(LoRARequest(lora_name=f"policy-{self._lora_id}",
                                                         lora_int_id=self._lora_id, lora_path=path,
                                                         load_inplace=True))
        return LoRARequest(lora_name=f"policy-{self._lora_id}", lora_int_id=self._lora_id, lora_path=path)

    # ----------------------------------------------------------------------------------------------- sampling
    def _generate(self, prompts: list, sampling: Sampling, progress: bool, drafts: Any = None) -> Rollout:
        from vllm import SamplingParams

        self.wake()
        prompt_ids = encode_prompts(self.tokenizer, prompts)  # as the engine encodes chat-templated text
        eos = list(sampling.eos_token_ids) if sampling.eos_token_ids is not None \
            else default_eos_ids(self.model, self.tokenizer)
        if sampling.stop_strings and not self._detokenize:
            raise ValueError(f"rollout.stop_strings need vLLM to detokenize, but {self.options.base} has no tokenizer "
                             "files")
        seeds = list(sampling.row_seeds) if sampling.row_seeds is not None else \
            [None if sampling.seed is None else sampling.seed + i for i in range(len(prompts))]
        params = [SamplingParams(max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                 top_p=sampling.top_p, top_k=sampling.top_k, stop=list(sampling.stop_strings),
                                 include_stop_str_in_output=True, stop_token_ids=eos, ignore_eos=not eos,
                                 logprobs=0, seed=seed, detokenize=self._detokenize) for seed in seeds]
        self._copy_norms()
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=progress,
                                    lora_request=self._lora_request())
        completion_ids, logprobs, reasons = [], [], []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            completion_ids.append(ids)
            logprobs.append(torch.tensor([step[t].logprob for step, t in zip(c.logprobs, ids)], dtype=torch.float32))
            reasons.append("length" if c.finish_reason == "length" else
                           "stop" if isinstance(c.stop_reason, str) else "eos")
        return Rollout(prompt_ids=prompt_ids, completion_ids=completion_ids,
                       texts=[decode_ids(self.tokenizer, ids) for ids in completion_ids], logprobs=logprobs,
                       stop_reasons=reasons)

    def reduced_precision(self) -> list[str]:
        kv8 = ["vLLM's FP8 KV cache (rollout.kv_cache_dtype)"] if self.options.kv_cache_dtype == "fp8" else []
        return super().reduced_precision() + ["vLLM's kernels (another engine's numerics than the update's)", *kv8]

    # ------------------------------------------------------------------------------------------------- memory
    def wake(self) -> None:
        """Take vLLM's pool back for a rollout. PyTorch's cache goes back to the driver first: the update leaves
        tens of GiB cached, and waking beside them put the 7B step's device peak at 104 GiB against the trainer's
        60 (vLLM's sleep empties that cache anyway, so the next update re-grows it either way)."""
        if self._asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up()
            releasable.set_released_bytes(torch.cuda.current_device(), 0)
            self._asleep = False

    def sleep(self) -> None:
        """Give vLLM's pool back to the driver for the update. Its tensors stay allocated in PyTorch's eyes, so
        the bytes the device gets back are declared (`releasable`): without that the update's peak counted the
        sleeping pool (106.5 GiB for the 7B step, 66 of them the trainer's). vLLM's sleep empties PyTorch's cache
        at its end anyway; emptying it first keeps the trainer's cached blocks out of the count."""
        if self.options.sleep_level and not self._asleep:
            torch.cuda.empty_cache()
            device = torch.cuda.current_device()  # where vLLM runs (the trainer's device)
            free = torch.cuda.mem_get_info(device)[0]
            self.llm.sleep(level=self.options.sleep_level)
            releasable.set_released_bytes(device, torch.cuda.mem_get_info(device)[0] - free)
            self._asleep = True

    def free(self) -> None:
        self.sleep()

    def close(self) -> None:
        shutil.rmtree(self._adapter_dir, ignore_errors=True)
        if self._asleep:  # the engine may be freed from here on; over-counting is the safe side
            releasable.set_released_bytes(torch.cuda.current_device(), 0)
