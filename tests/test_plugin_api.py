"""The public API a plugin imports from (prefect_tinker/plugin.py): its names are pinned here (a
rename or removal fails this test: a breaking change for plugins), each resolves to the object its
module defines, the type-checking imports agree with the lazy table, nothing heavier than the module of
a used name is imported, and the demo plugin of the tests imports nothing else of ours."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import prefect_tinker.plugin as plugin

ROOT = Path(__file__).resolve().parent.parent

PUBLIC = {
    "ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "BENCHMARKS", "BenchmarkSpec", "CODE_RUNNERS", "CONVERTERS",
    "CaptureStore", "DataFormat",
    "ENVS", "Env", "EnvContext", "EnvGroupBuilder", "Environment", "EvalStore", "FormatOptions", "GRADERS",
    "LOSSES", "MessageEnv", "OBJECTIVE_INPUTS", "Problem", "ProblemEnv", "RECIPES", "RENDERERS", "RLDataset",
    "RLLoss", "Recipe",
    "RecipeConfig", "Registry", "Renderer", "RolloutContext", "RunContext", "RunSession", "S3Credentials",
    "StepLoop", "StepResult", "TinkerCredentials", "TrainingStore", "Trajectory", "UnknownComponentError",
    "connect_stores", "problem_builder", "recipe_flow", "register_advantage_estimator", "register_code_runner",
    "register_converter", "register_env", "register_grader", "register_loss", "register_renderer", "tokenizer",
    "train_step", "Schedule", "RLLoopParts", "register_schedule", "SCHEDULES",
    "ServiceKey", "ServiceResources", "Services", "SERVICES", "register_service", "MissingServiceError", "JUDGE",
    "PAIR_PREFERENCES", "SAMPLER", "SANDBOX", "RETRIEVAL", "WIN_RATE_EVALUATOR",
    "FileType", "register_file_type", "FILE_TYPES", "RawRecord", "SourceSpec", "register_builtin_dataset",
    "BUILTIN_DATASETS", "DPOVariant", "register_dpo_loss", "DPO_LOSSES", "RESUME",
}


def _tables() -> tuple[dict[str, str], dict[str, str]]:
    """(the lazy table, the TYPE_CHECKING imports) of plugin.py, both as {name: module}."""
    tree = ast.parse(Path(plugin.__file__).read_text())
    lazy: dict[str, str] = {}
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "_MODULES":
            lazy = ast.literal_eval(node.value)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                typed.update({a.name: imp.module for a in imp.names})
    return lazy, typed


def test_public_names_are_pinned_and_resolve_to_their_modules_objects():
    assert set(plugin.__all__) == PUBLIC
    lazy, typed = _tables()
    assert lazy == typed
    for name, module in lazy.items():
        assert getattr(plugin, name) is getattr(importlib.import_module(module), name), name
    try:
        plugin.RunSessionn  # noqa: B018 (a misspelt name is refused with the list)
    except AttributeError as e:
        assert "RunSessionn" in str(e) and "RunSession" in str(e)
    else:
        raise AssertionError("an unknown name resolved")


def test_a_name_imports_only_its_own_module():
    code = (
        "import sys\nfrom prefect_tinker.plugin import Environment, register_env\n"
        "print(sorted(m for m in sys.modules if m.startswith('prefect_tinker.flows')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_demo_plugin_imports_only_the_public_api():
    ours = ("prefect_tinker", "tinker_blocks", "tinker_local")
    seen = set()
    for path in (ROOT / "tests" / "plugins").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            seen |= {n for n in names if n.split(".")[0] in ours}
    assert seen == {"prefect_tinker.plugin"}
