"""Step specs the tools tests load: ``tiny_step.py`` (a good one and broken ones), and every way
a spec text can go wrong, with the words its error must contain."""

from pathlib import Path

TINY_STEP = Path(__file__).parent / "tiny_step.py"
DATA_SPECS = Path(__file__).parent / "data_specs.py"

BAD_SPECS = [
    ("no_colon_here", "is not a step spec"),
    ("tests/tools/specs/does_not_exist.py:step", "no such file"),
    ("graphsplit_no_such_module:step", "cannot import module"),
    (f"{TINY_STEP}:missing", "has no function 'missing'"),
    (f"{TINY_STEP}:not_a_spec", "not a graphsplit.StepSpec"),
    (f"{TINY_STEP}:raises", "RuntimeError: boom"),
    (f"{DATA_SPECS}:loader_and_dataset", "drop dataset, num_workers"),
    (f"{DATA_SPECS}:bad_storage_dtype", "torch.bfloat16 or torch.float16"),
    (f"{DATA_SPECS}:bad_num_workers", "num_workers=-1"),
]
