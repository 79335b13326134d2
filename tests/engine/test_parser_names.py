"""The serve flags' parser choices are exactly the parsers that exist."""

from pagoda.entrypoints.openai.defaults import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES
from pagoda.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagoda.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS


def test_flag_choices_name_every_parser():
    assert set(TOOL_CALL_PARSER_NAMES) == set(TOOL_CALL_PARSERS)
    assert set(REASONING_PARSER_NAMES) == set(REASONING_PARSERS)
