"""The ``tim`` command line."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="tim-megatron: MoE RL with a view on training-inference mismatch.",
)
recipe_app = typer.Typer(no_args_is_help=True, help="Resolve and validate recipes.")
simulate_app = typer.Typer(no_args_is_help=True, help="Numerical simulations.")
app.add_typer(recipe_app, name="recipe")
app.add_typer(simulate_app, name="simulate")

console = Console()
err = Console(stderr=True)


def _fail(msg: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {msg}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(code)


@recipe_app.command("show")
def recipe_show(
    recipe: Path, overrides: list[str] = typer.Argument(None, help="dotted key=value overrides")
) -> None:
    """Print the fully resolved recipe (inheritance and overrides applied, defaults filled in)."""
    from tim_megatron.recipe import RecipeError, load_recipe, recipe_to_yaml

    try:
        loaded = load_recipe(recipe, overrides or [])
    except RecipeError as e:
        _fail(str(e))
    sys.stdout.write(
        f"# run name: {loaded.name}\n# files: {' <- '.join(str(p) for p in reversed(loaded.chain))}\n"
    )
    sys.stdout.write(recipe_to_yaml(loaded.recipe))


@recipe_app.command("check")
def recipe_check(
    root: Path = typer.Argument(Path("recipes"), help="folder (or one file) to validate"),
) -> None:
    """Validate every recipe and sweep file under a folder, offline."""
    from tim_megatron.recipe.loader import check_dir

    results = check_dir(root) if root.is_dir() else check_dir_single(root)
    bad = [(p, e) for p, e in results if e]
    for p, e in results:
        console.print(f"{'[green]ok[/]  ' if not e else '[red]FAIL[/]'} {p}", highlight=False)
        if e:
            console.print("      " + e.replace("\n", "\n      "), highlight=False, markup=False)
    console.print(f"{len(results) - len(bad)}/{len(results)} recipes valid", highlight=False)
    if not results:
        _fail(f"no recipes found under {root}")
    if bad:
        raise typer.Exit(1)


def check_dir_single(path: Path):
    from tim_megatron.recipe import RecipeError, load_recipe
    from tim_megatron.recipe.sweep import is_sweep_file, load_sweep

    try:
        load_sweep(path) if is_sweep_file(path) else load_recipe(path)
        return [(path, None)]
    except RecipeError as e:
        return [(path, str(e))]


@simulate_app.command("precision")
def simulate_precision_cmd(
    vocab: int = typer.Option(2048, help="vocabulary size"),
    samples: int = typer.Option(50_000, help="sampled tokens"),
    logit_std: float = typer.Option(1.5, help="std of the float32 logits"),
    seed: int = typer.Option(1234, help="random seed"),
    mantissa_bits: int = typer.Option(7, help="quantizer mantissa bits (7 = bf16, 10 = fp16)"),
) -> None:
    """The BF16-softmax experiment of the objective-level-hacking paper (its Table 2), via our injection code."""
    from tim_megatron.simulate import simulate_precision

    if vocab < 2 or samples < 1 or logit_std <= 0:
        _fail(f"need vocab >= 2, samples >= 1, logit_std > 0 (got {vocab}, {samples}, {logit_std})")
    r = simulate_precision(
        vocab=vocab, samples=samples, logit_std=logit_std, seed=seed, mantissa_bits=mantissa_bits
    )
    console.print(
        f"ratio p_fp32/p_q{mantissa_bits} over {r.samples} sampled tokens (vocab {vocab}, logit std {logit_std}, seed {seed})",
        highlight=False,
    )
    print("seed\tmean\tstd\tmax\tmin\tKL(q||fp32)")
    print(f"{seed}\t{r.mean:.4f}\t{r.std:.4f}\t{r.max:.4f}\t{r.min:.4f}\t{r.kl:.3e}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
