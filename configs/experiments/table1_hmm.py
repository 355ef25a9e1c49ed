"""Table 1's comparison (AdamW vs adversarial vs lookup table) on the HMM language. The paper has no such table: its
Table 1 and Table 2 are on the PCFG (`table1.py`, `table2.py`). flatlm adds this one because the HMM is the language
whose models reach the "same loss" band on two CPU cores, so it is the reproduction suite's C3 at cpu scale."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("flatlm_table1", Path(__file__).with_name("table1.py"))
_table1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_table1)


def get_config(arg: str = "tiny"):
    return _table1.get_config(arg, default_language="hmm")
