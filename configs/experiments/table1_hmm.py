"""Table 1's comparison (AdamW vs adversarial vs lookup table) on the HMM language. The paper has no such table: its
Table 1 and Table 2 are on the PCFG (`table1.py`, `table2.py`). flatlm adds this one because the HMM is the language
whose models reach the "same loss" band on two CPU cores, so it is the reproduction suite's C3 at cpu scale."""

from pathlib import Path

from flatlm.config import load_module

_table1 = load_module(Path(__file__).with_name("table1.py"))


def get_config(arg: str = "tiny"):
    return _table1.get_config(arg, default_language="hmm")
