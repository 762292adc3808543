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
    "LOSSES", "MessageEnv", "OBJECTIVE_INPUTS", "Problem", "ProblemEnv", "ProblemGroupBuilder", "RECIPES",
    "RENDERERS", "RLDataset",
    "RLLoss", "Recipe",
    "RecipeConfig", "Registry", "Renderer", "RolloutContext", "RunContext", "RunSession", "S3Credentials",
    "StepLoop", "StepResult", "TinkerCredentials", "TrainingStore", "Trajectory", "Transition",
    "UnknownComponentError",
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


def test_problem_builder_makes_a_builder_of_the_given_class_that_can_use_a_service(monkeypatch):
    """``problem_builder``: the spec's prompt settings and the context's sizes and renderer in each
    builder; ``builder=`` a ProblemGroupBuilder subclass whose ``make_envs_in`` hands its envs a service."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    import prefect_tinker.recipes.rl.problem_env as problem_env
    from prefect_tinker.plugin import (
        EnvContext, Problem, ProblemEnv, ProblemGroupBuilder, RolloutContext, ServiceKey, Services, problem_builder)

    class Echo(ProblemEnv):
        table: dict = {}

    @dataclass(frozen=True)
    class Tabled(ProblemGroupBuilder):
        def make_envs_in(self, ctx):
            envs = self.make_envs()
            for env in envs:
                env.table = ctx.service(TABLE)
            return envs

    TABLE: ServiceKey[dict] = ServiceKey("test_table", dict)
    monkeypatch.setattr(problem_env, "load_renderer", lambda name, tok: ("renderer", name, tok))
    spec = SimpleNamespace(system_prompt="Be brief.", few_shot=True, format_coef=0.5, format_needs_stop=True)
    ctx = EnvContext(renderer_name="role_colon", tokenizer_id="tok", group_size=3, groups_per_batch=1)
    shot = ({"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"})
    make = problem_builder(Echo, spec, ctx, shot, " Number only.", "echo", builder=Tabled)
    built = make(Problem(question="2+2?", answer="4"))
    assert type(built) is Tabled and built.logging_tags() == ["echo"] and built.group_size == 3
    envs = built.make_envs_in(RolloutContext(sample=None, services=Services(given={"test_table": {"2+2?": 4}})))
    assert len(envs) == 3 and all(type(e) is Echo and e.table == {"2+2?": 4} for e in envs)
    env = envs[0]
    assert env.renderer == ("renderer", "role_colon", "tok") and env.format_coef == 0.5 and env.format_needs_stop
    assert env.messages() == [{"role": "system", "content": "Be brief."}, *map(dict, shot),
                              {"role": "user", "content": "2+2? Number only."}]
    assert type(problem_builder(Echo, spec, ctx, (), "", "echo")(Problem("q", "a"))) is ProblemGroupBuilder
