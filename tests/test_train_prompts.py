"""Training prompts drawn from the corpus: code tasks (signature + docstring) and functions asked
for in words (a docstring's summary), jspec.train.data."""

from jspec.tokenizer import Tokenizer
from jspec.train.data import (DESCRIPTION_TEMPLATES, described_task_text, docstring_summary,
                              function_descriptions, function_tasks)

SOURCE = '''import os


def add(a, b):
    """Return the sum of a and b.

    Longer text that is not part of the summary.
    """
    return a + b


def sizes(paths):
    """Returns the sizes of the files
    at the given paths."""
    return [os.path.getsize(p) for p in paths]


def helper(x):
    """The helper used by add."""
    return x


def doctest_only(x):
    """>>> doctest_only(1)
    1
    """
    return x


def HTTP(x):
    """HTTP request wrapper that does many things."""
    return x


def short(x):
    """Do it."""
    return x


def undocumented(x):
    return x
'''


def test_function_tasks_find_documented_functions_only():
    heads = [head for head, _ in function_tasks(SOURCE)]
    assert len(heads) == 6  # every def with a docstring and a body, not `undocumented`
    assert heads[0].startswith("import os\n\n\ndef add(a, b):")
    assert all("undocumented" not in h for h in heads)


def test_docstring_summaries_read_as_tasks():
    assert function_descriptions(SOURCE) == [
        ("return the sum of a and b", "imperative"),
        # a summary over two lines is one sentence; "Returns" is a third-person verb
        ("returns the sizes of the files at the given paths", "third_person"),
    ]
    # skipped: a noun phrase ("The helper ..."), doctest text, an acronym, under 16 characters
    for head in ('def f():\n    """The helper used by add."""', 'def f():\n    """>>> f()\n    """',
                 'def f():\n    """HTTP request wrapper that does many things."""',
                 'def f():\n    """Do it."""', "def f():\n    pass"):
        assert docstring_summary(head) is None, head
    assert docstring_summary("def f():\n    '''Process the queue until it is empty!'''") == (
        "process the queue until it is empty", "imperative")  # "ss" is not a third person


def test_described_task_is_a_chat_turn_with_no_code():
    tok = Tokenizer.qwen3()
    template = DESCRIPTION_TEMPLATES["imperative"][0]
    text = described_task_text(tok, "return the sum of a and b", template)
    assert "Write a function to return the sum of a and b.<|im_end|>" in text
    # the same template as the code tasks and the benchmark prompts: one user turn, non-thinking
    assert text == tok.apply_chat_template([{"role": "user", "content": "Write a function to return "
                                                                         "the sum of a and b."}])
    assert text.startswith("<|im_start|>user\n") and "```" not in text
    for form, templates in DESCRIPTION_TEMPLATES.items():
        assert all(t.count("{task}") == 1 for t in templates), form
