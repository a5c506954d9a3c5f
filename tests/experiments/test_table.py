"""The one markdown table writer: its layout and its cell rule."""

from experiments.table import cell, markdown_row, markdown_table


def test_a_table_has_a_header_a_rule_and_one_line_per_row():
    table = markdown_table(["method", "tau", ""], [["a", 1.234, "**chosen**"], ["b", None, ""]])
    assert table.split("\n") == ["| method | tau | |", "|---|---|---|",
                                 "| a | 1.23 | **chosen** |", "| b | - |  |"]


def test_the_cell_rule():
    assert cell(None) == "-" and cell(None, ".1f") == "-"  # a figure that does not apply
    assert cell(0.125) == "0.12" and cell(3) == "3" and cell("x") == "x" and cell(True) == "True"
    assert cell(0.954, ".0%") == "95%" and cell(5, ".1f") == "5.0"
    assert markdown_row(["a", 2.0, None]) == "| a | 2.00 | - |"
