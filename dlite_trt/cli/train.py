"""`dlite-trt train`: an initial draft, data from the target, the history-aware teacher, the student.

    dlite-trt train init    --target T --out DRAFT
    dlite-trt train data    --target T --prompts SRC --out DATA
    dlite-trt train teacher --target T --data DATA --init DRAFT --out TEACHER
    dlite-trt train student --target T --data DATA --init DRAFT --teacher TEACHER --out DRAFT_OUT
                            [--single-stage]

Every job resumes from its own checkpoints when run again with the same --out. Run under
`torchrun --nproc-per-node N` for data-parallel training (gloo on CPU, nccl on GPUs).
"""

from __future__ import annotations

from pathlib import Path

import click

from dlite_trt.cli.inputs import SEED, TEMPERATURE, writable_out
from dlite_trt.config import MAX_BLOCK_SIZE

SEQUENCES = "sequences.jsonl"
CORPUS_WINDOW = 256  # tokens of each corpus window `train inform` reads the target's states over


def _target(target: str, random_weights: bool, bf16: bool = False):
    from transformers.utils import logging as hf_logging

    from dlite_trt.targets import build_hf_model, load_tokenizer, resolve_target

    hf_logging.disable_progress_bar()
    source = resolve_target(target, random_weights=random_weights)
    import torch

    return source, build_hf_model(source, torch.bfloat16 if bf16 else torch.float32), load_tokenizer(source)


def _init_distributed() -> None:
    import os

    import torch

    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _batches(seq_len: int, batch_seqs: int, anchors: int, seed: int, anchor_region: str, anchor_weight: str,
             min_context: int):
    from dlite_trt.training.pipeline import BatchSettings

    return BatchSettings(seq_len=seq_len, batch_seqs=batch_seqs, anchors=anchors, seed=seed,
                         anchor_region=anchor_region, anchor_weight=anchor_weight, min_context=min_context)


def _common(f):
    for option in reversed([
        click.option("--target", required=True, help="Model directory, .gguf file or preset name."),
        click.option("--data", "data", required=True, type=click.Path(path_type=Path, file_okay=False),
                     help="Directory written by `dlite-trt train data` (answered prompts, a state cache, or a "
                          "corpus: one, or several in subdirectories mixed by mix.json)."),
        click.option("--init", "init", required=True, type=click.Path(path_type=Path, file_okay=False),
                     help="dlite_v1 checkpoint to start from (its config defines the draft)."),
        click.option("--out", required=True, type=click.Path(path_type=Path, file_okay=False), callback=writable_out,
                     help="Checkpoint directory to write (a run with the same --out resumes)."),
        click.option("--seq-len", default=128, show_default=True, type=click.IntRange(min=4),
                     help="Tokens per training window cut from a sequence."),
        click.option("--batch-seqs", default=8, show_default=True, type=click.IntRange(min=1),
                     help="Sequence windows per step (split across data-parallel ranks)."),
        click.option("--anchors", default=16, show_default=True, type=click.IntRange(min=1),
                     help="Draft blocks per sequence window per step."),
        click.option("--anchor-region", default="window", show_default=True, type=click.Choice(["window", "answer"]),
                     help="Where blocks are anchored: anywhere in the window, or only where they draft the "
                          "target's own answer (what decoding drafts; better on SmolLM2, docs/training.md)."),
        click.option("--anchor-weight", default="uniform", show_default=True, type=click.Choice(["uniform", "depth"]),
                     help="Corpus data: anchors drawn uniformly, or in proportion to how many of their labels are "
                          "exact (the target's greedy continuation)."),
        click.option("--min-context", default=1, show_default=True, type=click.IntRange(min=1),
                     help="Corpus data: the first anchor position in a window (the least context its states have)."),
        click.option("--lr", default=3e-4, show_default=True, type=click.FloatRange(min=0, min_open=True),
                     help="Peak learning rate (then a cosine decay to a tenth of it)."),
        click.option("--seed", default=0, show_default=True, type=int,
                     help="Seed of the batches (same seed, same run)."),
        click.option("--random-weights", is_flag=True, help="With a preset --target: random weights of that shape."),
        click.option("--quiet", is_flag=True, help="No progress display."),
        click.option("--bf16", is_flag=True,
                     help="The target's pass in bf16 (a bf16 copy of its weights) and the draft's forward under bf16 "
                          "autocast (fp32 master weights): about 1.7x a step on a CPU with AMX (docs/training.md); "
                          "the labels differ from fp32's at near-ties (about 2% of positions). The draft is saved "
                          "as always."),
    ]):
        f = option(f)
    return f


def _load(target: str, random_weights: bool, data: Path, init: Path, bf16: bool = False):
    """(target adapter, training data, initial draft): the data is the state cache when `train
    data --states-for` wrote one there (no target forward while training), else the sequences.
    ``bf16``: the target's weights in bf16 (its states and logits come back fp32)."""
    from dlite_trt.checkpoint import load_draft
    from dlite_trt.errors import ConfigError
    from dlite_trt.model.target import TargetAdapter
    from dlite_trt.training.data import read_sequences
    from dlite_trt.training.state_cache import META, StateCache

    from dlite_trt.training.corpus import META as CORPUS
    from dlite_trt.training.corpus import read_corpus_mix

    written = [data / META, data / SEQUENCES, data / CORPUS, *(p / CORPUS for p in data.iterdir())] \
        if data.is_dir() else []
    if not any(path.is_file() for path in written):  # before the target loads
        raise ConfigError(f"--data {data} is not what `dlite-trt train data` writes (no {SEQUENCES}, state cache or "
                          f"corpus there); run `dlite-trt train data --target T --prompts FILE --out {data}` (or "
                          "--corpus) first.")
    source, hf, _ = _target(target, random_weights, bf16)
    draft = load_draft(init, target=source.spec)
    adapter = TargetAdapter(hf, source.spec, draft.cfg.target_layer_ids).eval().requires_grad_(False)
    if (data / META).is_file():
        return adapter, StateCache(data, draft.cfg.target_layer_ids, source.spec.vocab_size), draft
    mix = read_corpus_mix(data, source.spec.vocab_size)
    if mix is not None:
        return adapter, mix, draft
    return adapter, read_sequences(data / SEQUENCES, source.spec.vocab_size), draft


@click.group("train")
def command() -> None:
    """Train DLite drafts with the two-stage recipe (data, teacher, student)."""


DEFAULT_CHS_LAYERS = 5  # DLite's S: the target layers the draft reads


@command.command("init")
@click.option("--target", required=True, help="Model directory, .gguf file or preset name.")
@click.option("--out", required=True, type=click.Path(path_type=Path, file_okay=False), callback=writable_out,
              help="Directory to write the draft checkpoint into (new or empty).")
@click.option("--layers", default=5, show_default=True, type=click.IntRange(min=1), help="Draft decoder layers.")
@click.option("--chs-layers", type=click.IntRange(min=2),
              help="Target layers the draft reads (S, at most the target's layers) [default: 5, or the target's "
                   "layers where it has fewer].")
@click.option("--block-size", default=8, show_default=True, type=click.IntRange(2, MAX_BLOCK_SIZE),
              help="Tokens per speculative block: the anchor and K = block size - 1 proposals.")
@click.option("--anchor-group-size", default=1, show_default=True, type=click.IntRange(min=1),
              help="Tokens ending with the anchor that the draft reads (G).")
@click.option("--rank", default=256, show_default=True, type=click.IntRange(min=1),
              help="Rank of the sequential head's recurrent state.")
@click.option("--mask-token-id", type=click.IntRange(min=0),
              help="Token id of the proposal slots' input [default: the tokenizer's mask token, else its unknown "
                   "token].")
@click.option("--draft-vocab-size", type=click.IntRange(min=2),
              help="A reduced draft vocabulary: the head proposes among this many target tokens, the most frequent "
                   "in --vocab-from (verification stays over the full vocabulary) [default: all of them].")
@click.option("--vocab-from", type=click.Path(path_type=Path, file_okay=False),
              help="With --draft-vocab-size: a corpus from `dlite-trt train data --corpus` to count tokens in.")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the initial weights.")
@click.option("--random-weights", is_flag=True, help="With a preset --target: its shape only (no weights needed).")
def init(target: str, out: Path, layers: int, chs_layers: int, block_size: int, anchor_group_size: int, rank: int,
         mask_token_id: int | None, draft_vocab_size: int | None, vocab_from: Path | None, seed: int,
         random_weights: bool) -> None:
    """Write an untrained dlite_v1 draft shaped for the target (the --init of teacher/student)."""
    from dlite_trt.targets import load_tokenizer, resolve_target, stop_token_ids
    from dlite_trt.training.init_draft import pick_mask_token, write_initial_draft

    if (draft_vocab_size is None) != (vocab_from is None):
        raise click.UsageError("--draft-vocab-size and --vocab-from go together")
    source = resolve_target(target, random_weights=random_weights)
    most = source.spec.num_hidden_layers
    if chs_layers is not None and chs_layers > most:
        raise click.BadParameter(f"{chs_layers} target layers to read, and the target has {most}; pass at most {most}.",
                                 param_hint="--chs-layers")
    chs_layers = min(DEFAULT_CHS_LAYERS, most) if chs_layers is None else chs_layers
    tokenizer = load_tokenizer(source)
    mask = pick_mask_token(tokenizer, source.spec, stop_token_ids(source, tokenizer), mask_token_id)
    draft_vocab = None
    if vocab_from is not None:
        from dlite_trt.training.corpus import frequent_vocabulary, read_corpus_mix

        mix = read_corpus_mix(vocab_from, source.spec.vocab_size)
        if mix is None:
            raise click.UsageError(f"{vocab_from} holds no corpus; write one with `dlite-trt train data --corpus`")
        counts = sum(part.token_counts(source.spec.vocab_size) for part in mix.parts)
        draft_vocab = frequent_vocabulary(counts, draft_vocab_size, must_include=[mask]).tolist()
    cfg = write_initial_draft(out, source.spec, mask, seed=seed, draft_vocab=draft_vocab, num_hidden_layers=layers,
                              chs_num_layers=chs_layers, block_size=block_size, anchor_group_size=anchor_group_size,
                              sequential_rank=rank)
    token = tokenizer.convert_ids_to_tokens(mask) if tokenizer is not None else mask
    click.echo(f"untrained dlite_v1 draft -> {out}: {layers} layers reading target layers "
               f"{list(cfg.target_layer_ids)}, block size {block_size}, mask token {token!r} ({mask}); train it with "
               "`dlite-trt train teacher/student --init`")


@command.command("data")
@click.option("--target", required=True, help="Model directory, .gguf file or preset name.")
@click.option("--prompts", type=click.Path(path_type=Path),
              help="JSONL of prompts ({prompt|messages|input_ids}) or a directory of text files, answered by the "
                   "target.")
@click.option("--corpus", type=click.Path(path_type=Path),
              help="Instead of --prompts: real code, no answers generated (exact labels from one pass of the "
                   "target while training): a directory of Python files or a file listing files and directories.")
@click.option("--chat-share", default=0.3, show_default=True, type=click.FloatRange(0, 1, max_open=True),
              help="With --corpus: the share of training windows from the files' documented functions framed as "
                   "chat turns (request from the docstring, the code as the answer).")
@click.option("--out", required=True, type=click.Path(path_type=Path, file_okay=False), callback=writable_out,
              help="Directory to write sequences.jsonl into.")
@click.option("--max-prompt-tokens", default=256, show_default=True, type=click.IntRange(min=1),
              help="Longest prompt, in tokens (longer ones keep their last tokens).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1),
              help="Most answer tokens per prompt (fewer when an end-of-sequence token comes first).")
@click.option("--max-prompts", type=click.IntRange(min=1), help="Use at most this many prompts [default: all].")
@click.option("--temperature", default=0.0, show_default=True, type=TEMPERATURE,
              help="0 = greedy answers; > 0 = sampled answers.")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(min=1),
              help="Prompts answered together in one batch.")
@click.option("--states-for", "states_for", type=click.Path(path_type=Path, file_okay=False),
              help="A dlite_v1 draft (e.g. from `train init`): also cache the target's states for its layers "
                   "(fp16 hidden states, top-k next-token probabilities) so that training runs no target forward. "
                   "Greedy only; resumable.")
@click.option("--top-k", default=32, show_default=True, type=click.IntRange(min=1),
              help="With --states-for: tokens of the target's distribution kept per position.")
@click.option("--seed", default=0, show_default=True, type=SEED,
              help="Seed of the prompt cuts and of sampling (same seed, same data).")
@click.option("--random-weights", is_flag=True, help="With a preset --target: random weights of that shape.")
def data(target: str, prompts: Path | None, corpus: Path | None, chat_share: float, out: Path, max_prompt_tokens: int,
         max_new_tokens: int, max_prompts: int | None, temperature: float, batch_size: int, states_for: Path | None,
         top_k: int, seed: int, random_weights: bool) -> None:
    """Answer prompts with the target itself (token ids to OUT/sequences.jsonl), or tokenize a
    corpus of real code into OUT (--corpus)."""
    from dlite_trt.model.target import TargetAdapter
    from dlite_trt.runtime.reference import SpeculativeGenerator
    from dlite_trt.targets import stop_token_ids
    from dlite_trt.training.data import answer_prompts, read_prompts, write_sequences

    if (prompts is None) == (corpus is None):
        raise click.UsageError("pass either --prompts (answered by the target) or --corpus (real code)")
    if corpus is not None:
        from dlite_trt.targets import load_tokenizer, resolve_target
        from dlite_trt.training.corpus import listed_sources, write_corpus_parts

        source = resolve_target(target, random_weights=random_weights)
        tokenizer = load_tokenizer(source)
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise click.UsageError(f"{target} has no tokenizer with an end-of-sequence token to build a corpus with")
        sizes = write_corpus_parts(listed_sources(corpus), tokenizer, out, chat_share=chat_share,
                                   eos_id=tokenizer.eos_token_id, tokenizer_name=source.name,
                                   vocab_size=source.spec.vocab_size, seed=seed)
        click.echo(f"corpus {sizes} -> {out}; train on it with --data {out}")
        return
    source, hf, tokenizer = _target(target, random_weights)
    ids = read_prompts(prompts, tokenizer, max_prompt_tokens=max_prompt_tokens, max_prompts=max_prompts, seed=seed)
    stops = stop_token_ids(source, tokenizer)
    if states_for is not None:
        from dlite_trt.checkpoint import check_draft_fits_target, load_draft_config
        from dlite_trt.training.state_cache import write_state_cache

        if temperature > 0:
            raise click.UsageError("--states-for caches greedy answers; drop --temperature")
        cfg = load_draft_config(states_for)
        check_draft_fits_target(cfg, source.spec)
        layers = cfg.target_layer_ids
        adapter = TargetAdapter(hf, source.spec, layers).eval()
        cached = write_state_cache(adapter, ids, out, layer_ids=layers, max_new_tokens=max_new_tokens,
                                   stop_token_ids=stops, top_k=top_k, batch_size=batch_size, target_name=source.name,
                                   log=lambda done, total, rate: click.echo(f"{done}/{total} prompts, {rate:.0f} "
                                                                            "answer tokens/s", err=True))
        click.echo(f"{cached} sequences with the target's states for layers {list(layers)} -> {out}")
        return
    adapter = TargetAdapter(hf, source.spec, (source.spec.num_hidden_layers - 1,))
    generator = SpeculativeGenerator.target_only(adapter)
    sequences = answer_prompts(generator, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                               batch_size=batch_size, stop_token_ids=stops)
    path = write_sequences(sequences, out / SEQUENCES)
    tokens = sum(len(s.answer_ids) for s in sequences)
    click.echo(f"{len(sequences)} sequences, {tokens} answer tokens -> {path}")


@command.command("teacher")
@_common
@click.option("--window", default=16, show_default=True, type=click.IntRange(min=0),
              help="Past positions the teacher sees beyond the pivot.")
@click.option("--steps", default=1000, show_default=True, type=click.IntRange(min=1), help="Training steps.")
def teacher(target, data, init, out, seq_len, batch_seqs, anchors, anchor_region, anchor_weight, min_context, lr, seed,
            random_weights, quiet, bf16, window, steps) -> None:
    """Train the isomorphic history-aware teacher."""
    from dlite_trt.training.pipeline import train_teacher
    from dlite_trt.training.trainer import TrainSettings

    _init_distributed()
    adapter, sequences, draft = _load(target, random_weights, data, init, bf16)
    train_teacher(adapter, sequences, draft, out, TrainSettings(steps=steps, lr=lr, bf16=bf16),
                  _batches(seq_len, batch_seqs, anchors, seed, anchor_region, anchor_weight, min_context), window,
                  progress=not quiet)
    click.echo(f"teacher -> {out}")


@command.command("student")
@_common
@click.option("--teacher", "teacher_dir", type=click.Path(path_type=Path, file_okay=False),
              help="Teacher from `dlite-trt train teacher` (needed for stage 1).")
@click.option("--stage1-steps", default=500, show_default=True, type=click.IntRange(min=0),
              help="Stage 1 steps: KL to the teacher.")
@click.option("--stage2-steps", default=1000, show_default=True, type=click.IntRange(min=1),
              help="Stage 2 steps: CE + TV against the target.")
@click.option("--single-stage", is_flag=True, help="Skip stage 1 (the ablation): stage 2 for both budgets.")
def student(target, data, init, out, seq_len, batch_seqs, anchors, anchor_region, anchor_weight, min_context, lr, seed,
            random_weights, quiet, bf16, teacher_dir, stage1_steps, stage2_steps, single_stage) -> None:
    """Train the student: stage 1 (KL to the teacher), stage 2 (CE + TV against the target)."""
    from dlite_trt.training.pipeline import StudentPlan, load_teacher, train_student

    _init_distributed()
    adapter, sequences, draft = _load(target, random_weights, data, init, bf16)
    if single_stage:
        plan = StudentPlan(stage1_steps=0, stage2_steps=stage1_steps + stage2_steps, lr=lr, bf16=bf16)
    else:
        if teacher_dir is None:
            raise click.UsageError("two-stage training needs --teacher DIR (or pass --single-stage)")
        plan = StudentPlan(stage1_steps=stage1_steps, stage2_steps=stage2_steps, lr=lr, bf16=bf16)
    mentor = load_teacher(teacher_dir) if plan.stage1_steps else None
    train_student(adapter, sequences, draft, out, plan,
                  _batches(seq_len, batch_seqs, anchors, seed, anchor_region, anchor_weight, min_context), mentor,
                  progress=not quiet)
    click.echo(f"dlite_v1 draft -> {out}")


@command.command("inform")
@click.option("--target", required=True, help="Model directory, .gguf file or preset name.")
@click.option("--data", "data", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="A state cache (`dlite-trt train data --states-for INIT`) or a corpus (`--corpus`).")
@click.option("--init", "init", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="The dlite_v1 checkpoint from `dlite-trt train init`.")
@click.option("--out", required=True, type=click.Path(path_type=Path, file_okay=False), callback=writable_out,
              help="Where the informed dlite_v1 checkpoint goes (a new directory); train from it with --init.")
@click.option("--sequences", default=200, show_default=True, type=click.IntRange(min=1),
              help="Cached sequences (or corpus windows) whose states the initialisation is computed from.")
@click.option("--seed", default=0, show_default=True, type=int, help="Which sequences.")
@click.option("--random-weights", is_flag=True, help="With a preset --target: random weights of that shape.")
def inform(target: str, data: Path, init: Path, out: Path, sequences: int, seed: int, random_weights: bool) -> None:
    """A target-informed initialisation of INIT from the target and its cached states (centred
    context slots, the head's output side a whitened rank-r factorisation of the LM head, its
    token embedding from the LM head's principal directions, the target's final norm)."""
    from dlite_trt.checkpoint import save_draft
    from dlite_trt.training.informed_init import informed_init, sample_states
    from dlite_trt.training.init_draft import require_new_dir
    from dlite_trt.training.state_cache import META

    from dlite_trt.training.corpus import CorpusMix
    from dlite_trt.training.informed_init import sample_corpus_states

    require_new_dir(out)
    adapter, cache, draft = _load(target, random_weights, data, init)
    if isinstance(cache, CorpusMix):  # states of the target over corpus windows, one sequence's worth each
        states = sample_corpus_states(adapter, cache, sequences, CORPUS_WINDOW, seed=seed)
    elif (data / META).is_file():
        states = sample_states(cache, sequences, seed=seed)
    else:
        raise click.UsageError(f"{data} is neither a state cache (no {META}; `dlite-trt train data --states-for "
                               "INIT`) nor a corpus (`dlite-trt train data --corpus`).")
    informed_init(draft, adapter.lm_head.weight, adapter.model.norm.weight, None, states)
    save_draft(draft, out)
    click.echo(f"informed dlite_v1 draft -> {out}")
