"""The training jobs behind `dlite-trt train`: teacher, then student (two stages, or one).

A batch (``BatchSource``) is a function of the step: ``batch_seqs`` sequences chosen with a
seeded generator (sharded across ranks), cut to ``seq_len``-token windows, run through the
frozen target for hidden states and logits, and ``anchors`` blocks drawn per window.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dlite_trt.checkpoint import save_draft
from dlite_trt.errors import CheckpointError, ConfigError
from dlite_trt.model.draft import DLiteDraft
from dlite_trt.model.target import TargetAdapter
from dlite_trt.training.corpus import CorpusMix, exact_depth
from dlite_trt.training.data import TrainingSequence, window_starts, window_tokens
from dlite_trt.training.examples import DraftExamples, TargetTopK, draft_examples, target_states
from dlite_trt.training.losses import DEFAULT_WEIGHTS, LossWeights
from dlite_trt.training.state_cache import StateCache
from dlite_trt.training.stages import adopt_teacher_head, release_head, stage1_loss, stage2_loss, teacher_loss
from dlite_trt.training.teacher import HistoryAwareTeacher, window_layers
from dlite_trt.training.trainer import TrainSettings, train

TEACHER_WEIGHTS = "teacher.safetensors"
TEACHER_CONFIG = "teacher.json"
# sequences, sequences with their cached states, or a corpus (the target runs over its text: exact labels)
TrainingData = Sequence[TrainingSequence] | StateCache | CorpusMix
ANCHOR_REGIONS = ("window", "answer")
ANCHOR_WEIGHTS = ("uniform", "depth")
LOG_EVERY = 10  # steps between progress lines when stderr is not a terminal


@dataclass(frozen=True)
class BatchSettings:
    seq_len: int = 128
    batch_seqs: int = 8
    anchors: int = 16  # blocks per window
    seed: int = 0
    anchor_region: str = "window"  # "window": anywhere in it; "answer": blocks that draft the target's answer
    # corpus mode (a CorpusMix: the target runs over each window, no generated answers; labels count
    # only up to the first disagreement of text and target)
    anchor_weight: str = "uniform"  # corpus mode: "depth" draws anchors in proportion to their exact labels
    min_context: int = 1  # corpus mode: the first anchor position in a window (the states' least context)
    top_k: int = 256  # corpus mode: the target's distribution kept per position (TV over these + the rest)

    def __post_init__(self) -> None:
        if self.seq_len < 4 or self.batch_seqs < 1 or self.anchors < 1:
            raise ConfigError(f"invalid batch settings {self}: need seq_len >= 4, batch_seqs >= 1, anchors >= 1")
        if self.anchor_region not in ANCHOR_REGIONS:
            raise ConfigError(f"anchor_region must be one of {', '.join(ANCHOR_REGIONS)}, got {self.anchor_region!r}")
        if self.anchor_weight not in ANCHOR_WEIGHTS:
            raise ConfigError(f"anchor_weight must be one of {', '.join(ANCHOR_WEIGHTS)}, got {self.anchor_weight!r}")
        if self.min_context < 1 or self.top_k < 1:
            raise ConfigError(f"invalid batch settings {self}: need min_context >= 1, top_k >= 1")


class BatchSource:
    """batch(step, rank, world) -> DraftExamples, deterministic in (seed, step).

    ``data``: the sequences (the frozen target is run on each batch for its states), or a
    ``StateCache`` of them (the states are read from disk: no target forward)."""

    def __init__(self, target: TargetAdapter, data: TrainingData, draft: DLiteDraft,
                 settings: BatchSettings, window: int = 0) -> None:
        self.target, self.settings, self.window = target, settings, window
        self.corpus = data if isinstance(data, CorpusMix) else None
        self.cache = data if isinstance(data, StateCache) else None
        self.sequences = data.sequences if isinstance(data, StateCache) else data
        self.cfg = draft.cfg
        self.device = target.embed_weight.device  # batches are built where the target runs (CPU or GPU)
        self.blocks_seen = 0

    def __call__(self, step: int, rank: int, world: int) -> DraftExamples:
        s = self.settings
        g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
        if self.corpus is not None:
            return self._corpus_batch(g, rank, world)
        rows = torch.randint(0, len(self.sequences), (s.batch_seqs,), generator=g).tolist()
        starts = window_starts(self.sequences, s.seq_len, rows, seed=s.seed * 7919 + step)
        if s.anchor_region == "window":
            anchors = torch.randint(1, s.seq_len - 1, (s.batch_seqs, s.anchors), generator=g)
        else:  # blocks whose first proposal is an answer token: anchors from the last prompt token on
            firsts = [min(max(1, len(self.sequences[r].prompt_ids) - 1 - start), s.seq_len - 2)
                      for r, start in zip(rows, starts, strict=True)]
            anchors = torch.stack([torch.randint(first, s.seq_len - 1, (s.anchors,), generator=g) for first in firsts])
        mine = slice(rank * s.batch_seqs // world, (rank + 1) * s.batch_seqs // world)
        tokens = window_tokens(self.sequences, s.seq_len, rows[mine], starts[mine]).to(self.device)
        if self.cache is None:
            hidden, logits = target_states(self.target, tokens)
        else:
            parts = [self.cache.window(r, start, s.seq_len) for r, start in zip(rows[mine], starts[mine], strict=True)]
            hidden = torch.stack([p["hidden"] for p in parts]).to(self.device)
            logits = TargetTopK(torch.stack([p["top_ids"] for p in parts]).to(self.device),
                                torch.stack([p["top_probs"] for p in parts]).to(self.device))
        self.blocks_seen += anchors[mine].numel()
        return draft_examples(tokens, hidden, logits, anchors[mine].to(self.device), self.cfg.anchor_group_size,
                              self.cfg.num_proposals, self.window, window_layers(self.cfg))

    def _corpus_batch(self, g: torch.Generator, rank: int, world: int) -> DraftExamples:
        """Windows of the corpus, the target run over each (teacher forcing), anchors from
        ``min_context`` on (weighted by their exact labels with anchor_weight "depth"); every
        label past the text's first disagreement with the target is masked."""
        s, k_props = self.settings, self.cfg.num_proposals
        tokens = self.corpus.windows(s.batch_seqs, s.seq_len, g)  # [B, L]
        mine = slice(rank * s.batch_seqs // world, (rank + 1) * s.batch_seqs // world)
        tokens = tokens[mine].to(self.device)
        hidden, logits = target_states(self.target, tokens)
        top = TargetTopK.of_logits(logits, s.top_k)
        del logits
        lo, hi = s.min_context, s.seq_len - 1  # anchors in [lo, hi)
        if hi - lo < s.anchors:
            raise ConfigError(f"{s.anchors} anchors per window do not fit between min_context {lo} and position "
                              f"{hi - 1} of a {s.seq_len}-token window; lower anchors or min_context")
        weight = torch.ones(tokens.shape[0], hi - lo)
        if s.anchor_weight == "depth":  # drawn on the CPU by the seeded generator, wherever the target runs
            weight = exact_depth(tokens, top.ids[..., 0], k_props)[:, lo:hi].float().cpu()
        anchors = (lo + torch.multinomial(weight, s.anchors, replacement=False, generator=g)).to(self.device)  # [B, A]
        self.blocks_seen += anchors.numel()
        return draft_examples(tokens, hidden, top, anchors, self.cfg.anchor_group_size, k_props, self.window,
                              window_layers(self.cfg), exact_only=True)


def _logger(progress: bool, total: int, what: str) -> tuple[Callable[[int, dict], None], Callable[[], None]]:
    """A rich progress bar showing the loss, draft blocks/s and the time left; (log, close)."""
    if not progress:
        return (lambda step, terms: None), (lambda: None)
    if not sys.stderr.isatty():  # a log file: a plain line every LOG_EVERY steps
        def line(step: int, terms: dict) -> None:
            if (step + 1) % LOG_EVERY == 0 or step + 1 == total:
                shown = "  ".join(f"{k} {v:.4f}" for k, v in terms.items() if k not in ("blocks_per_s", "seconds"))
                print(f"[{time.strftime('%H:%M:%S')}] {what} {step + 1}/{total}  {shown}  "
                      f"{terms['blocks_per_s']:.0f} blocks/s", file=sys.stderr, flush=True)

        return line, (lambda: None)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    bar = Progress(TextColumn(f"{what} {{task.completed}}/{{task.total}}"), BarColumn(),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    task = bar.add_task(what, total=total, info="")
    bar.start()

    def log(step: int, terms: dict) -> None:
        bar.update(task, completed=step + 1, info=f"loss {terms['loss']:.4f}  {terms['blocks_per_s']:.0f} blocks/s")

    return log, bar.stop


def _main_process() -> bool:
    """Rank 0 (or not distributed): the process that shows progress and writes results."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _run(module, loss_fn, source: BatchSource, settings: TrainSettings, out: Path, what: str,
         progress: bool) -> None:
    log, close = _logger(progress and _main_process(), settings.steps, what)
    started = time.perf_counter()

    def with_speed(step: int, terms: dict) -> None:
        log(step, terms | {"blocks_per_s": source.blocks_seen / max(time.perf_counter() - started, 1e-9)})

    try:
        train(module, loss_fn, source, settings, out, with_speed)
    finally:
        close()


def train_teacher(target: TargetAdapter, data: TrainingData, init: DLiteDraft, out: Path,
                  settings: TrainSettings, batches: BatchSettings, window: int,
                  weights: LossWeights = DEFAULT_WEIGHTS, progress: bool = True) -> HistoryAwareTeacher:
    """Train the history-aware teacher (initialised from ``init``'s weights); saved under ``out``."""
    teacher = HistoryAwareTeacher(init.cfg, window)
    teacher.draft.load_state_dict(init.state_dict())
    embed = target.embed_weight.detach().float()
    source = BatchSource(target, data, init, batches, window)
    _run(teacher.train(), lambda m, ex: teacher_loss(m, ex, embed, weights), source, settings, out / "teacher-run",
         "teacher", progress)
    if _main_process():
        save_file({k: v.detach().contiguous() for k, v in teacher.state_dict().items()}, str(out / TEACHER_WEIGHTS))
        (out / TEACHER_CONFIG).write_text(json.dumps({"window": window, "draft_config": init.cfg.to_dict()},
                                                     indent=2))
    return teacher.eval()


def load_teacher(directory: Path) -> HistoryAwareTeacher:
    from dlite_trt.config import DraftConfig

    try:
        meta = json.loads((directory / TEACHER_CONFIG).read_text())
        teacher = HistoryAwareTeacher(DraftConfig.from_dict(meta["draft_config"]), int(meta["window"]))
        teacher.load_state_dict(load_file(str(directory / TEACHER_WEIGHTS)), strict=True)
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot load a teacher from {directory} ({exc}); train one with "
                              "`dlite-trt train teacher`.") from exc
    return teacher.eval()


@dataclass(frozen=True)
class StudentPlan:
    stage1_steps: int  # 0: single-stage (stage 2 only)
    stage2_steps: int
    lr: float = 3e-4
    snapshot_every: int = 0  # > 0: keep stage 2's weights every this many steps (a training-steps curve)
    checkpoint_every: int = 100  # resumable state every this many steps
    bf16: bool = False  # the draft's forward under bf16 autocast (TrainSettings.bf16)

    def to_dict(self) -> dict:
        return asdict(self)


def train_student(target: TargetAdapter, data: TrainingData, student: DLiteDraft, out: Path,
                  plan: StudentPlan, batches: BatchSettings, teacher: HistoryAwareTeacher | None = None,
                  weights: LossWeights = DEFAULT_WEIGHTS, progress: bool = True, runs: Path | None = None) -> Path:
    """Stage 1 (KL to the teacher, its head adopted and frozen) then stage 2 (CE + TV against the
    target); the result is a dlite_v1 checkpoint in ``out``. Each stage's resumable state goes
    under ``runs`` (default: ``out``)."""
    runs = out if runs is None else runs
    embed = target.embed_weight.detach().float()
    if plan.stage1_steps:
        if teacher is None:
            raise ConfigError("stage 1 needs a teacher; pass one, or train single-stage (stage1_steps = 0)")
        if teacher.cfg != student.cfg:
            raise ConfigError("the teacher's draft config differs from the student's; they must be isomorphic")
        adopt_teacher_head(student, teacher)
        source = BatchSource(target, data, student, batches, teacher.window)
        _run(student.train(), lambda m, ex: stage1_loss(m, teacher, ex, embed, weights), source,
             TrainSettings(steps=plan.stage1_steps, lr=plan.lr, checkpoint_every=plan.checkpoint_every, bf16=plan.bf16),
             runs / "stage1-run", "stage 1", progress)
        release_head(student)  # the transition: everything trains again, now against the target
    source = BatchSource(target, data, student, batches)
    _run(student.train(), lambda m, ex: stage2_loss(m, ex, embed, weights), source,
         TrainSettings(steps=plan.stage2_steps, lr=plan.lr, snapshot_every=plan.snapshot_every,
                       checkpoint_every=plan.checkpoint_every, bf16=plan.bf16), runs / "stage2-run", "stage 2",
         progress)
    if _main_process():  # every replica holds the same weights; one writes them
        save_draft(student.eval(), out)
        (out / "training.json").write_text(json.dumps({"plan": plan.to_dict(), "batches": asdict(batches),
                                                       "loss_weights": asdict(weights)}, indent=2))
    return out
