"""What a run's outputs need is installed by every stack, or is optional and refused at parse time where it is
missing: a device run must not end on an ImportError while it writes its record (or while it cleans up, which
is when the curves PNG is drawn).

The imports are read from the modules that write the outputs, so a new import there fails this test until it is
pinned (relax/pins.py OUTPUT_PACKAGES) or made optional.
"""

import ast
import re
import runpy
import sys
from pathlib import Path

import pytest

from helpers import DRY_RUN as RUN
from relax.args import parse_train_args

REPO = Path(__file__).resolve().parents[2]
PINS = runpy.run_path(str(REPO / "relax" / "pins.py"))

# The modules that write a run's outputs: metrics.jsonl, TensorBoard, wandb, the PNG and the summary; checkpoints
# and HF directories (during the run and by `relax convert`).
OUTPUT_MODULES = ["relax/run/metrics.py", "relax/train/checkpoint.py", "relax/hf_checkpoint/__init__.py", "relax/tools/convert.py"]
# The training stack every stack is built around (megatron-core requires numpy).
TRAINING_STACK = {"torch", "megatron", "numpy"}
# torch.utils.tensorboard is torch's module, but it imports the tensorboard package.
PACKAGE_OF_MODULE = {"torch.utils.tensorboard": "tensorboard"}
# Output packages a run uses only when a flag asks for them.
OPTIONAL = {"wandb": "--use-wandb"}
STACKS = {"CPU stack": PINS["CPU_STACK"], "CUDA stack": PINS["CUDA_STACK"], "NPU image": PINS["NPU_IMAGE_EXTRAS"]}


def imports(path: Path, module_level_only: bool = False) -> set[str]:
    """The third-party modules a file imports (inside functions too, unless module_level_only)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return {name for name in names if name.split(".")[0] not in sys.stdlib_module_names | {"relax"}}


def package(module: str) -> str | None:
    """The package an import needs beyond the training stack (None: the training stack's own)."""
    if module in PACKAGE_OF_MODULE:
        return PACKAGE_OF_MODULE[module]
    top = module.split(".")[0]
    return None if top in TRAINING_STACK else top


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


@pytest.mark.parametrize("module", OUTPUT_MODULES)
def test_every_output_import_is_pinned_or_optional(module):
    needed = {package(name) for name in imports(REPO / module)} - {None}
    unknown = needed - set(PINS["OUTPUT_PACKAGES"]) - set(OPTIONAL)
    assert not unknown, (
        f"{module} imports {sorted(unknown)}: add them to OUTPUT_PACKAGES in relax/pins.py, which every stack "
        "installs, or make them optional behind a flag that `relax train` checks"
    )


def test_the_scan_sees_the_output_imports():
    """The outputs of relax/run/metrics.py as they are: TensorBoard, the progress bar, the PNG, wandb."""
    needed = {package(name) for name in imports(REPO / "relax/run/metrics.py")}
    assert {"tensorboard", "tqdm", "matplotlib", "wandb"} <= needed


@pytest.mark.parametrize("stack", list(STACKS))
def test_every_stack_installs_the_output_packages(stack):
    missing = set(PINS["OUTPUT_PACKAGES"]) - requirement_names(STACKS[stack])
    assert not missing, f"the {stack} (relax/pins.py) does not install {sorted(missing)}"


@pytest.mark.parametrize("module", OUTPUT_MODULES)
def test_optional_packages_are_imported_only_where_used(module):
    at_import = {package(name) for name in imports(REPO / module, module_level_only=True)} & set(OPTIONAL)
    assert not at_import, f"{module} imports {sorted(at_import)} when it is imported; import it where it is used"


def test_an_optional_package_that_is_missing_is_refused_at_parse_time(pretend_wandb_installed, capsys):
    pretend_wandb_installed(installed=False)
    with pytest.raises(SystemExit) as exit_info:
        parse_train_args([*RUN, OPTIONAL["wandb"]])
    assert exit_info.value.code == 2
    assert "--use-wandb logs through wandb, which is not installed: install it (pip install wandb)" in (
        capsys.readouterr().err
    )
    assert not parse_train_args(RUN).outputs.wandb_project  # without the flag nothing needs it

    pretend_wandb_installed(installed=True)
    assert parse_train_args([*RUN, OPTIONAL["wandb"]]).outputs.wandb_project
