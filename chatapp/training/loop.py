"""The STT training loop: token windows in, a trained model directory out.

Input is a `TokenStream` (concatenated token ids and loss mask; how text becomes ids is the caller's business:
`training.corpus` for corpus files, the tiny recipe for its synthetic corpus). The stream is cut into windows
that start where sequences start (`TokenStream`); every epoch visits them in a seeded permutation, and the batch of
step s on rank r is a pure function of (seed, s, r): resuming from a checkpoint replays exactly the batches an
uninterrupted run would have seen, and ranks never share a window (DistributedSampler-style sharding).

The default model's recipe (`recipes.smollm2.train`) runs its own loop over padded, length-grouped conversations
with LoRA, per-group clipping and two phases; it shares the schedule, the checkpoint writer and the calibration.

Multi-GPU runs use torchrun: `init_distributed()` reads RANK / WORLD_SIZE / LOCAL_RANK, the model is wrapped in
DistributedDataParallel (its `forward` is the teacher's training forward), and rank 0 alone evaluates, reports
and writes checkpoints: `out_dir/checkpoints/step_NNNNNN/` directories (`training.checkpoint.save_step`: staged and
renamed into place, then a `latest` pointer replaced atomically).
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from chatapp.errors import TrainingError
from chatapp.stt.io import load_state_dict, save_model
from chatapp.stt.model import STTForCausalLM
from chatapp.training.checkpoint import latest_step, save_step
from chatapp.training.evaluation import EvalReport, evaluate
from chatapp.training.schedule import warmup_cosine
from chatapp.training.steps import Clipping, Steps

STATE_NAME = "trainer_state.pt"


@dataclass
class TokenStream:
    """Training tokens laid end to end: ids (N,) and loss mask (N,) (True = the token is a prediction target).

    `starts` (sorted offsets of each sequence's first token, e.g. each conversation's BOS), when known, aligns the
    windows to sequences: a window begins where a sequence begins, so every target sees its sequence's start (the
    question an answer copies from, the BOS generation starts at). Cutting the stream at multiples of the window
    length instead left 26% of the default corpus's answer tokens trained without their question in the window,
    i.e. trained to guess the operands they should copy.
    """

    ids: torch.Tensor
    loss_mask: torch.Tensor
    starts: torch.Tensor | None = None
    _offsets: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_sequences(cls, sequences: Iterable[tuple[list[int], list[int]]]) -> TokenStream:
        """Concatenate (ids, loss_mask) sequences, e.g. rendered conversations each starting with BOS."""
        ids: list[int] = []
        mask: list[int] = []
        starts: list[int] = []
        for seq_ids, seq_mask in sequences:
            if len(seq_ids) != len(seq_mask):
                raise ValueError(f"ids and loss mask differ in length ({len(seq_ids)} vs {len(seq_mask)})")
            if seq_ids:
                starts.append(len(ids))
            ids.extend(seq_ids)
            mask.extend(seq_mask)
        return cls(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(mask, dtype=torch.bool),
            torch.tensor(starts, dtype=torch.long),
        )

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def window_offsets(self, seq_len: int) -> torch.Tensor:
        """The first token of each window of `seq_len` tokens, in stream order (computed once per length).

        Without `starts`: multiples of `seq_len`. With them: a window starts at a sequence start, and the next one at
        the start of the sequence the window cut off at its end, so every sequence up to `seq_len` tokens long lies
        whole in some window (the cut sequence's head is also trained, with its start, in the window before). A
        sequence longer than a window goes on in the next window from where the last one ended.
        """
        if seq_len not in self._offsets:
            total = len(self)
            if self.starts is None:
                offsets = torch.arange(total // seq_len) * seq_len
            else:
                starts = self.starts.tolist()
                found, position = [], 0
                while position + seq_len <= total:
                    found.append(position)
                    end = position + seq_len
                    last = bisect.bisect_right(starts, end) - 1  # the last sequence start at or before `end`
                    position = starts[last] if last >= 0 and starts[last] > position else end
                offsets = torch.tensor(found, dtype=torch.long)
            self._offsets[seq_len] = offsets
        return self._offsets[seq_len]

    def num_windows(self, seq_len: int) -> int:
        return int(self.window_offsets(seq_len).shape[0])

    def windows(self, indices: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows `indices` as (ids, loss_mask), each (len(indices), seq_len)."""
        offsets = self.window_offsets(seq_len)[indices][:, None] + torch.arange(seq_len)[None, :]
        return self.ids[offsets], self.loss_mask[offsets]

    def batches(self, batch_size: int, seq_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every window once, in order (for evaluation)."""
        count = self.num_windows(seq_len)
        for start in range(0, count, batch_size):
            yield self.windows(torch.arange(start, min(start + batch_size, count)), seq_len)


@dataclass
class TrainConfig:
    """How to train (the model's own settings, e.g. per-group learning rates, live in its STTConfig)."""

    steps: int = 1000
    batch_size: int = 8  # windows per rank and step
    seq_len: int = 256
    lr_scale: float = 1.0  # multiplies every parameter group's learning rate
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decay to this fraction of the peak
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    eval_interval: int = 0  # 0: evaluate only at the end
    eval_batches: int = 8
    checkpoint_interval: int = 0  # 0: at every evaluation

    def lr_factor(self, step: int) -> float:
        """Linear warmup, then cosine decay to `min_lr_ratio` (`schedule.warmup_cosine`)."""
        return warmup_cosine(step, self.steps, self.warmup_steps, self.min_lr_ratio)


@dataclass
class StepReport:
    """What the loop reports after a step (rank 0 only)."""

    step: int  # steps done
    steps: int
    losses: dict[str, float]
    lr_factor: float
    tokens_per_s: float
    teacher_fraction: list[float]
    student_f1: list[float]
    eval: EvalReport | None = None


@dataclass
class TrainResult:
    steps: int
    eval: EvalReport | None = None


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Join the torchrun process group when WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU); single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local)


class WindowSampler:
    """Seeded per-epoch permutations of window indices, sharded by rank; the batch of a step is stateless."""

    def __init__(self, num_windows: int, batch_size: int, seed: int, dist_info: DistInfo) -> None:
        self.num_windows, self.batch_size, self.seed, self.dist = num_windows, batch_size, seed, dist_info
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {
                epoch: torch.randperm(
                    self.num_windows, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                )
            }
        return self._perms[epoch]

    def indices(self, step: int) -> torch.Tensor:
        start = (step * self.dist.world_size + self.dist.rank) * self.batch_size
        positions = range(start, start + self.batch_size)
        return torch.stack([self._perm(p // self.num_windows)[p % self.num_windows] for p in positions])


# ---------------------------------------------------------------------------------------------------- checkpoints
def latest_checkpoint(out_dir: Path) -> Path | None:
    return latest_step(out_dir / "checkpoints")


def save_checkpoint(
    model: STTForCausalLM, optimizer: torch.optim.Optimizer, step: int, config: TrainConfig, out_dir: Path
) -> Path:
    """Write the model and the trainer state as checkpoint `step` in `out_dir/checkpoints` (`checkpoint.save_step`:
    atomic, `latest` pointed at it, older ones dropped)."""

    def write(directory: Path) -> None:
        save_model(model, directory)
        state = {"step": step, "optimizer": optimizer.state_dict(), "train_config": asdict(config)}
        torch.save(state, directory / STATE_NAME)

    return save_step(out_dir / "checkpoints", step, write)


def _load_checkpoint(model: STTForCausalLM, optimizer: torch.optim.Optimizer, path: Path) -> int:
    try:
        state = torch.load(path / STATE_NAME, map_location="cpu", weights_only=True)
        model.load_state_dict(load_state_dict(path), strict=not model.config.tie_word_embeddings)
        optimizer.load_state_dict(state["optimizer"])
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        raise TrainingError(
            f"cannot resume from {path}: {err}", hint="delete the checkpoint or start without --resume"
        ) from None
    return int(state["step"])


# ------------------------------------------------------------------------------------------------------- the loop
def _eval_batches(data: TokenStream, config: TrainConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(data.batches(config.batch_size, config.seq_len))[: config.eval_batches]


def train(
    model: STTForCausalLM,
    data: TokenStream,
    config: TrainConfig,
    *,
    eval_data: TokenStream | None = None,
    out_dir: str | Path | None = None,
    resume: bool = False,
    on_step: Callable[[StepReport], None] | None = None,
    dist_info: DistInfo | None = None,
) -> TrainResult:
    """Train `model` in place; with `out_dir`, checkpoint there and save the final model into it.

    The saved model has `routing_trained = true`, so generation uses the student router from then on.
    """
    dist_info = dist_info or DistInfo()
    windows = data.num_windows(config.seq_len)
    if windows < 1:
        raise TrainingError(
            f"the training corpus has {len(data)} tokens, fewer than one window of {config.seq_len}",
            hint="use a larger corpus or a smaller --seq-len",
        )
    out_dir = Path(out_dir) if out_dir is not None else None
    sampler = WindowSampler(windows, config.batch_size, config.seed, dist_info)
    groups = model.parameter_groups(config.lr_scale, config.weight_decay)
    for group in groups:
        group["base_lr"] = group["lr"]
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    start = 0
    if resume and out_dir is not None and (checkpoint := latest_checkpoint(out_dir)) is not None:
        start = _load_checkpoint(model, optimizer, checkpoint)
    runner: torch.nn.Module = model
    if dist_info.world_size > 1:
        devices = [model.device.index] if model.device.type == "cuda" else None
        runner = DistributedDataParallel(model, device_ids=devices)
    evaluation_set = _eval_batches(eval_data, config) if eval_data is not None else []
    checkpoint_every = config.checkpoint_interval or config.eval_interval
    report: EvalReport | None = None
    window_tokens = config.batch_size * config.seq_len * dist_info.world_size
    began = time.perf_counter()

    def compute(step: int):
        nonlocal began
        began = time.perf_counter()
        ids, mask = data.windows(sampler.indices(step), config.seq_len)
        return runner(ids.to(model.device), mask.to(model.device), step=step)

    def after(done: int, out) -> None:
        nonlocal report
        if not dist_info.is_main:
            return
        elapsed = time.perf_counter() - began
        report = None
        if evaluation_set and (done == config.steps or (config.eval_interval and done % config.eval_interval == 0)):
            report = evaluate(model, evaluation_set)
        if on_step is not None:
            on_step(
                StepReport(
                    step=done,
                    steps=config.steps,
                    losses={name: value.item() for name, value in out.losses.items()},
                    lr_factor=config.lr_factor(done - 1),
                    tokens_per_s=window_tokens / max(elapsed, 1e-9),
                    teacher_fraction=out.stats["teacher_fraction"].tolist(),
                    student_f1=out.stats["f1"].tolist(),
                    eval=report,
                )
            )

    def save(done: int) -> None:
        # The last step's state is the final model, which `out_dir` itself receives below.
        if out_dir is not None and dist_info.is_main and done < config.steps:
            save_checkpoint(model, optimizer, done, config, out_dir)

    model.train()
    Steps(
        optimizer,
        compute,
        lr=lambda step, group: group["base_lr"] * config.lr_factor(step),
        clip=Clipping([list(model.parameters())], config.grad_clip),
        after=after,
        checkpoint=save,
        checkpoint_every=checkpoint_every,
    ).run(start, config.steps)
    model.eval()
    model.config.routing_trained = True
    if out_dir is not None and dist_info.is_main:
        save_model(model, out_dir)
    return TrainResult(steps=config.steps, eval=report)
