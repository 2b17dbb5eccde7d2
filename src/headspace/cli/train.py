"""The ``headspace train``, ``headspace plot-run`` and ``headspace generate`` commands.

User errors (bad data file, values out of range, an output folder holding another run, a corrupt or
foreign checkpoint) are one line on stderr with exit code 2.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..core.errors import UsageError
from .errors import check_input
from .loader import at_precision, load_model
from .options import choice_option, model_choice_option, precision_option, seed_value
from .output import check_writable_folder, output_folder


def _fail(e: Exception) -> UsageError:
    return UsageError(str(e).replace("\n", " "))


@click.command("train")
@choice_option(
    "--task",
    choices=["relations", "reverse", "text"],
    default=None,
    help="Built-in synthetic task (default relations; 'text' with --data).",
)
@click.option(
    "--data",
    type=click.Path(dir_okay=False),
    default=None,
    help="UTF-8 text file: train a character- or byte-level language model on it.",
)
@choice_option("--level", choices=["char", "byte"], default="char")
@choice_option("--arch", choices=["decoder", "encoder"], default="decoder")
@click.option("--layers", "n_layers", type=int, default=None, help="Transformer blocks (task default).")
@click.option("--heads", "n_heads", type=int, default=None, help="Heads per layer (relations: 2).")
@click.option("--d-model", type=int, default=None, help="Residual width (relations: 64).")
@click.option("--d-mlp", type=int, default=None, help="Feed-forward width (4 * d_model).")
@click.option("--seq-len", type=int, default=None, help="Text window length (128).")
@click.option("--batch-size", type=int, default=None)
@click.option("--steps", type=int, default=None, help="Optimizer steps (relations: 400).")
@click.option("--lr", type=float, default=None, help="Peak learning rate (AdamW).")
@click.option("--warmup", type=int, default=50, show_default=True)
@click.option("--weight-decay", type=float, default=0.01, show_default=True)
@click.option("--grad-clip", type=float, default=1.0, show_default=True)
@click.option("--dropout", type=float, default=0.0, show_default=True)
@click.option("--eval-every", type=int, default=None, help="Evaluate every N steps (relations: 25).")
@click.option(
    "--eval-batch", type=int, default=512, show_default=True, help="Held-out evaluation batch size."
)
@click.option(
    "--log-every", type=int, default=10, show_default=True, help="Log the training loss every N steps."
)
@click.option(
    "--save-every", type=int, default=0, show_default=True, help="Checkpoint every N steps (0: at the end)."
)
@click.option("--seed", type=int, default=0, show_default=True, callback=seed_value, help="0..2**63-1.")
@choice_option("--device", choices=["cpu", "cuda"], default="cpu")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="Run folder.")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its latest checkpoint.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def train_command(
    task: str | None, data: str | None, level: str, arch: str, n_layers: int | None, n_heads: int | None,
    d_model: int | None, d_mlp: int | None, seq_len: int | None, batch_size: int | None, steps: int | None,
    lr: float | None, warmup: int, weight_decay: float, grad_clip: float, dropout: float,
    eval_every: int | None, eval_batch: int | None, log_every: int, save_every: int, seed: int, device: str,
    out: str, resume: bool, no_progress: bool,
) -> None:  # fmt: skip
    """Train an Encoder or Decoder and watch its heads specialise (metrics, checkpoints, summary.json)."""
    from ..train.loop import TrainConfig, train

    if task is None:
        task = "text" if data is not None else "relations"
    check_writable_folder(out)  # before any training: a run that cannot be saved is not started
    if data is not None:
        check_input(data, "--data", "data file")
    config = TrainConfig(
        task=task, data=data, level=level, arch=arch, n_layers=n_layers, n_heads=n_heads, d_model=d_model,
        d_mlp=d_mlp, seq_len=seq_len, batch_size=batch_size, steps=steps, lr=lr, warmup=warmup,
        weight_decay=weight_decay, grad_clip=grad_clip, dropout=dropout, eval_every=eval_every,
        eval_batch=eval_batch, log_every=log_every, save_every=save_every, seed=seed, device=device,
    )  # fmt: skip
    result = train(config, out, resume=resume, progress=not no_progress)
    s = result.summary
    if s is not None and "relations" in s:
        click.echo(f"accuracy {s['accuracy']:.4f}  ({s['n_layers']} layer(s) x {s['n_heads']} head(s))")
        for name, r in s["relations"].items():
            click.echo(
                f"  {name:16s} head L{r['head'][0]}H{r['head'][1]}  "
                f"attention_mass {r['attention_mass']:.3f}  "
                f"ablation_drop {r['ablation_drop']:.3f}  other_drop {r['other_drop']:.3f}"
            )
    elif result.final_eval:
        click.echo(f"eval loss {result.final_eval['loss']:.4f}; run folder: {out}")
    if s is not None:
        click.echo(f"summary: {Path(out) / 'summary.json'}")


@click.command("plot-run")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False),
    default=None,
    help="PNG path (default RUN_DIR/heads_over_training.png).",
)
def plot_run_command(run_dir: str, out: str | None) -> None:
    """Draw the loss curves and per-head metrics over training of RUN_DIR (PNG)."""
    from ..viz.training import plot_run

    check_input(run_dir, "RUN_DIR", "run folder", "folder")
    if out is None:
        check_writable_folder(run_dir, "RUN_DIR")
    else:
        output_folder(check_writable_folder(Path(out).parent, "--out", out))
    path = plot_run(run_dir, out)
    click.echo(str(path))


@click.command("generate")
@click.argument("target", metavar="[RUN_DIR | PROMPT]", required=False, default=None)
@click.option("--prompt", default=None, help="Text to continue (with --model it may be the argument).")
@click.option("--tokens", "max_new_tokens", type=int, default=200, show_default=True)
@click.option("--temperature", type=float, default=0.8, show_default=True)
@click.option("--top-k", type=int, default=None)
@click.option("--seed", type=int, default=0, show_default=True, callback=seed_value, help="0..2**63-1.")
@model_choice_option(
    None, needs="It needs a decoder. Without --model, the argument is a training run folder (RUN_DIR)."
)
@precision_option
@click.option(
    "--chat",
    is_flag=True,
    default=False,
    help="With --model: the prompt as a user message in the model's chat template; prints the reply.",
)
def generate_command(
    target: str | None,
    prompt: str | None,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    model_spec: str | None,
    model_precision: str,
    chat: bool,
) -> None:
    """Continue a prompt with a language model (KV-cached decoding): the one trained in RUN_DIR
    (generate RUN_DIR --prompt TEXT) or a pretrained decoder (generate --model smollm2 "TEXT"), whose
    text is printed as it comes and ends where the model ends its text or turn."""
    if model_spec is not None:
        if target is not None and prompt is not None:
            raise UsageError("with --model, give the prompt once: as the argument or as --prompt, not both")
        text = target if prompt is None else prompt
        if text is None:
            raise UsageError('give the text to continue: headspace generate --model MODEL "PROMPT"')
        _generate_pretrained(model_spec, model_precision, text, max_new_tokens, temperature, top_k, seed,
                             chat)  # fmt: skip
        return
    if chat:
        raise UsageError("--chat needs a pretrained model with a chat template: give --model (e.g. smollm2)")
    if target is None:
        raise UsageError(
            "give a training run folder (headspace generate RUN_DIR --prompt TEXT) or a model "
            '(headspace generate --model smollm2 "TEXT")'
        )
    if prompt is None:
        raise UsageError(f"give the text to continue with --prompt (RUN_DIR {target}), or use --model")
    run_dir = target
    from ..train.checkpoint import CheckpointError
    from ..train.loop import generate_text

    if not Path(run_dir).is_dir():
        raise UsageError(f"RUN_DIR {run_dir} is not a folder")
    try:
        # generate_text takes precision= once train/loop.py has it (see the precision issue's note)
        kw = {} if model_precision == "float32" else {"precision": model_precision}
        text = generate_text(
            run_dir,
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            **kw,
        )
    except (ValueError, TypeError, CheckpointError, KeyError) as e:
        raise _fail(e) from None
    click.echo(text)


def _generate_pretrained(
    model_spec: str, precision: str, prompt: str, max_new_tokens: int, temperature: float,
    top_k: int | None, seed: int, chat: bool,
) -> None:  # fmt: skip
    """Print the prompt and its continuation by the pretrained decoder ``model_spec`` (with ``chat``
    the reply alone) piece by piece as it comes, then a newline; or one line saying what is wrong."""
    from ..core.defaults import is_decoder

    if not prompt.strip():
        raise UsageError(f"the prompt is empty ({prompt!r}); give at least one word to continue")
    model = at_precision(load_model(model_spec), precision)
    if not is_decoder(model):
        raise UsageError(
            f"--model {model_spec} is an encoder: generate needs a decoder (smollm2, or a GPT-2, Llama, "
            "Mistral or Qwen2 folder, or a .gguf file)"
        )
    if chat and model.chat_template_text() is None:
        raise UsageError(
            f"--chat needs the model's chat template; --model {model_spec} has none (no "
            "tokenizer.chat_template in its GGUF, no chat_template in its tokenizer_config.json)"
        )
    try:
        model.generate(prompt, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                       chat=chat, on_text=lambda piece: click.echo(piece, nl=False))  # fmt: skip
    except (ValueError, TypeError) as e:
        raise _fail(e) from None
    click.echo()


COMMANDS = (train_command, plot_run_command, generate_command)
