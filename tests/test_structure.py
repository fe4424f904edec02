"""The reference apart from its engine: the core modules (the top level's concept files) import
nothing from the engine, the harness or the data packages; nothing outside model.py assigns a
model's attributes; the loop and the drafts read a draft's declared interface, never getattr."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ("model.py", "tokenizer.py", "verify.py", "draft.py", "eagle3.py", "dflash.py", "speculative.py",
        "objectives.py")
SCRIPTS = ("decode.py", "train_vat.py", "bench.py")
PACKAGES = ("engine", "harness", "data", "experiments")


def imported_modules(path: Path) -> set:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_top_level_is_the_card_and_its_concepts():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert top == sorted(CORE + SCRIPTS), top
    assert len(top) <= 12


@pytest.mark.parametrize("name", CORE)
def test_a_core_module_imports_no_package(name):
    local = {p.stem for p in ROOT.glob("*.py")}
    imports = imported_modules(ROOT / name)
    assert not {m for m in imports if m.split(".")[0] in PACKAGES}, imports
    assert {m for m in imports if m in local} <= {Path(c).stem for c in CORE}  # no script either
    assert "time" not in imports  # timing is the caller's: it hands the loop a clock


def test_no_model_attribute_is_assigned_outside_model_py():
    """target.x = ... or model.x = ... only inside model.py: a model's modes are its methods."""
    offenders = []
    for path in [p for p in ROOT.rglob("*.py") if "tests" not in p.parts and p.name != "model.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and \
                            sub.value.id in ("target", "model", "probe"):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders


@pytest.mark.parametrize("name", ["speculative.py", "draft.py"])
def test_the_loop_reads_a_drafts_declared_interface(name):
    calls = [n for n in ast.walk(ast.parse((ROOT / name).read_text()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")]
    assert not calls


def test_every_draft_declares_the_interface():
    """Each draft class derives from draft.Draft, so what the loop reads is declared with its shapes."""
    import dflash
    import draft
    import eagle3
    for cls in (draft.NoDraft, draft.LookupDraft, draft.ModelDraft, draft.HybridDraft, draft.AdaptiveDraft,
                eagle3.Eagle3Draft, dflash.DFlashDraft):
        assert issubclass(cls, draft.Draft), cls
    declared = set(draft.Draft.__annotations__)
    assert {"target_layers", "forwards", "max_tokens", "free", "sizes_trees", "proposal_head_logits"} <= declared


def definition_lengths(path: Path) -> dict:
    """{name or Class.method: its length in lines} of a module's top-level definitions."""
    lengths = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            lengths[node.name] = node.end_lineno - node.lineno + 1
            for sub in node.body if isinstance(node, ast.ClassDef) else []:
                if isinstance(sub, ast.FunctionDef):
                    lengths[f"{node.name}.{sub.name}"] = sub.end_lineno - sub.lineno + 1
    return lengths


def test_readmes_reading_path_names_what_the_code_holds():
    """README's reading path comes in its first 40 lines, and every definition it names is in the
    file it names, as long as it says."""
    import re
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Read the code")
    assert readme[:start].count("\n") < 40
    rows = [line for line in readme[start:].split("\n## ", 1)[0].splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) == 5
    for row in rows:
        _, where, lines = [cell.strip() for cell in row.strip("|").split("|")]
        named = []
        for part in where.split(";"):
            file, _, names = part.partition(":")
            named += [(file.strip(" `"), name) for name in re.findall(r"`([\w.]+)`", names)]
        claimed = [int(n) for n in lines.split("+")]
        assert len(named) == len(claimed), row
        for (file, name), n in zip(named, claimed):
            actual = definition_lengths(ROOT / file).get(name)
            assert actual == n, f"README says {file}'s {name} is {n} lines; it is {actual}"


def function_node(path: Path, qualified: str):
    cls, _, name = qualified.rpartition(".")
    body = ast.parse(path.read_text()).body
    if cls:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_speculative_step_is_the_algorithm_alone():
    """speculative_step takes what the algorithm needs (<= 8 parameters) and neither times nor
    counts: a clock, Stats or a hook would be the measurement's, which observes from outside."""
    step = function_node(ROOT / "speculative.py", "speculative_step")
    params = [a.arg for a in step.args.args]
    assert len(params) <= 8, params
    names = {n.id for n in ast.walk(step) if isinstance(n, ast.Name)} | set(params)
    assert not names & {"clock", "stats", "Stats", "on_verify", "time"}, names


def test_one_attention_path_in_model_py():
    """Attention.forward takes at most 5 arguments and has one path (no branch, no loop); the
    engine's bit-exact forms live in engine/, swapped in from outside."""
    forward = function_node(ROOT / "model.py", "Attention.forward")
    assert len(forward.args.args) - 1 <= 5
    assert not [n for n in ast.walk(forward) if isinstance(n, (ast.If, ast.IfExp, ast.For, ast.ListComp))]
    assert len(function_node(ROOT / "model.py", "Block.forward").args.args) - 1 <= 5


@pytest.mark.parametrize("name", CORE)
def test_no_core_function_is_over_50_lines(name):
    long = {n: length for n, length in definition_lengths(ROOT / name).items()
            if length > 50 and not (n[0].isupper() and "." not in n)}  # (classes may be longer)
    assert not long, long


FIRST_TYPED = {"decode": ["--target", "--draft", "--verifier", "-k", "--prompt", "--temperature", "--max-new-tokens"],
               "train_vat": ["--target", "--draft", "--objective", "--data", "--steps", "--out", "--resume"],
               "bench": ["--target", "--drafts", "--verifiers", "--temperatures", "--limit", "--quick", "--out"]}


@pytest.mark.parametrize("script", FIRST_TYPED)
def test_help_opens_with_what_a_user_types_first(script, capsys, monkeypatch):
    """--help fits a screen (decode.py's, <= 45 lines; the others' first 45 lines) and holds the
    options a user types first; --help-all adds the rest, and they all still parse."""
    import importlib
    monkeypatch.setenv("COLUMNS", "80")
    module = importlib.import_module(script)

    def help_text(flag):
        with pytest.raises(SystemExit):
            module.get_args([flag])
        return capsys.readouterr().out
    short, full = help_text("--help"), help_text("--help-all")
    lines = short.splitlines()
    if script == "decode":
        assert len(lines) <= 45, len(lines)
    first_screen = "\n".join(lines[:45])
    for option in FIRST_TYPED[script]:
        assert f"  {option} " in first_screen or f"  {option}," in first_screen, option
    assert len(full.splitlines()) > len(lines) and "--help-all" in short
    assert "--seed" in full and "--seed" not in short
    assert module.get_args(["--seed", "3"]).seed == 3  # an option --help leaves out parses as before


@pytest.mark.parametrize("name", CORE)
def test_core_lines_fit_100_columns(name):
    long = [n for n, line in enumerate((ROOT / name).read_text().splitlines(), 1) if len(line) > 100]
    assert not long, f"{name}: lines {long}"
