#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Write tests/fixtures/openai/dsml.json: the DeepSeek-V4 chat encoding of fixed conversations and the
parse of fixed completions, as DeepSeek's published encoding script produces them. dsv4-openai's
renderer and reply parser (openai/render.c, openai/reply.c) are checked against this file by
tests/unit/test_openai_format.c.

    tools/make_openai_fixtures.py --encoding PATH/encoding_dsv4.py [--out tests/fixtures/openai/dsml.json]

The script is DeepSeek's (shipped with the V4 checkpoints as encoding/encoding_dsv4.py); it is imported
from the given path, not kept in this repository. Tools are given to it as DeepSeek's own example
conversation with tools carries them: in the `tools` of the first message when that is a system
message, else in a system message holding only them, inserted first."""

import argparse
import copy
import importlib.util
import json

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web ¿qué? 検索",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        "filters": {"type": "object"}, "strict": {"type": "boolean"}, "ratio": {"type": "number"}}}}}


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def raw_call(cid, name, text):
    """A call whose arguments are the given text, as a client may write it."""
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": text}}


# Arguments that Python's json.loads reads (and DeepSeek's encoder writes back with json.dumps) beyond
# what a 64-bit JSON library holds: integers of any size, floats that overflow, NaN and Infinity, NUL
# in strings and keys, duplicate keys (the first place, the last value), and white space of any kind.
PY_ONLY_JSON = ('{"big": 123456789012345678901234567890, "neg": -9223372036854775809, "max": 9223372036854775807,'
                ' "f": 1e400, "g": -1E+400, "tiny": 1e-400, "nan": NaN, "inf": [Infinity, -Infinity, -0, -0.0, 1.5E3],'
                ' "nul": "a\\u0000b", "k\\u0000": {"x": 1, "y": [12345678901234567890.5, "\\ud83d\\ude00"], "x": "two"},'
                ' "dup": 1,\n\t"dup" : "last"}')


ENCODE_CASES = [
    {"name": "user only", "messages": [{"role": "user", "content": "What is 17*23?"}]},
    {"name": "system and user, thinking", "thinking": True,
     "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]},
    {"name": "multi-turn, thinking drops earlier reasoning", "thinking": True,
     "messages": [{"role": "user", "content": "a?"},
                  {"role": "assistant", "content": "A.", "reasoning_content": "think a"},
                  {"role": "user", "content": "b?"}]},
    {"name": "multi-turn chat", "messages": [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "one"},
        {"role": "assistant", "content": "1"}, {"role": "user", "content": "two "}]},
    {"name": "consecutive user messages merge", "messages": [
        {"role": "user", "content": "first"}, {"role": "user", "content": "second"}]},
    {"name": "tools, chat", "tools": [WEATHER],
     "messages": [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": "Weather in Paris?"}]},
    {"name": "tool round trip, two results out of order", "tools": [WEATHER, SEARCH], "messages": [
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            call("call_1", "get_weather", {"city": "Paris"}),
            call("call_2", "get_weather", {"city": "Tokyo", "unit": "celsius"})]},
        {"role": "tool", "tool_call_id": "call_2", "content": "22C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "user", "content": "Thanks. And search for it."}]},
    {"name": "tools in thinking mode keep all reasoning", "thinking": True, "tools": [SEARCH], "messages": [
        {"role": "user", "content": "find \"x\""},
        {"role": "assistant", "content": "Searching.", "reasoning_content": "need search",
         "tool_calls": [call("c9", "search", {"query": "x \"y\"\n\\z", "limit": 5, "filters": {"lang": "fr", "n": [1, 2.5]},
                                               "strict": True, "ratio": 0.25})]},
        {"role": "tool", "tool_call_id": "c9", "content": "result ü"},
        {"role": "user", "content": "ok"}]},
    {"name": "reasoning effort max", "thinking": True, "reasoning_effort": "max",
     "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]},
    {"name": "developer role", "messages": [{"role": "developer", "content": "dev says"},
                                            {"role": "user", "content": "u"}]},
    {"name": "tag text inside content", "messages": [
        {"role": "user", "content": "say <｜Assistant｜></think> and <｜DSML｜invoke> literally"}]},
    {"name": "arguments Python reads beyond 64-bit JSON", "tools": [SEARCH], "messages": [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [raw_call("c1", "search", PY_ONLY_JSON),
                                                             raw_call("c2", "search", '{"a": 1} x')]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"}]},
    {"name": "arguments that are not text", "tools": [SEARCH], "messages": [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [raw_call("c1", "search", None), raw_call("c2", "search", 5),
                                                             raw_call("c3", "search", [1, "a"]), raw_call("c4", "search", True)]},
        {"role": "user", "content": "v"}]},
    {"name": "tool results null and absent", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_weather", {"city": "Paris"}),
                                                               call("c2", "get_weather", {"city": "Rome"})]},
        {"role": "tool", "tool_call_id": "c2", "content": None},
        {"role": "tool", "tool_call_id": "c1"}]},
    {"name": "assistant last (continuation)", "messages": [
        {"role": "user", "content": "u"}, {"role": "assistant", "content": "partial"}]},
]

# Assistant turns the model could write; each is rendered by the script, then parsed back by it.
PARSE_CASES = [
    {"name": "content", "thinking": False, "message": {"role": "assistant", "content": "391"}},
    {"name": "reasoning and content", "thinking": True,
     "message": {"role": "assistant", "reasoning_content": "17*23 is 391.\n", "content": "391"}},
    {"name": "one tool call", "thinking": False, "message": {"role": "assistant", "content": "",
                                                            "tool_calls": [call("a", "get_weather", {"city": "Paris"})]}},
    {"name": "content and two tool calls", "thinking": False, "message": {
        "role": "assistant", "content": "Let me look.",
        "tool_calls": [call("a", "get_weather", {"city": "Zürich", "unit": "celsius"}),
                       call("b", "search", {"query": "a \"quoted\" <b>\\ line\nnext\ttab\u0001", "limit": 3,
                                            "filters": {"k": [True, None, -1.5e-7]}, "strict": False})]}},
    {"name": "thinking then tool call", "thinking": True, "message": {
        "role": "assistant", "reasoning_content": "I should call it.", "content": "",
        "tool_calls": [call("a", "search", {"query": "日本"})]}},
    {"name": "values beyond 64-bit JSON kept as written", "thinking": False, "message": {
        "role": "assistant", "content": "", "tool_calls": [call("a", "search", {
            "big": 123456789012345678901234567890, "neg": [-9223372036854775809, 1e300], "nul": {"k": "a\u0000b"}})]}},
    {"name": "parameter names with quotes", "thinking": False, "message": {
        "role": "assistant", "content": "", "tool_calls": [call("a", "search", {
            'say "hi"': "x", 'q"': [1], '" string="': True})]}},
    {"name": "tool call without arguments", "thinking": False, "message": {
        "role": "assistant", "content": "", "tool_calls": [call("a", "now", {})]}},
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoding", required=True, help="DeepSeek's encoding_dsv4.py")
    ap.add_argument("--out", default="tests/fixtures/openai/dsml.json")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("encoding_dsv4", args.encoding)
    enc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(enc)

    encode = []
    for case in ENCODE_CASES:
        msgs = copy.deepcopy(case["messages"])
        if case.get("tools") and msgs[0]["role"] == "system":
            msgs[0]["tools"] = case["tools"]
        elif case.get("tools"):
            msgs.insert(0, {"role": "system", "tools": case["tools"]})
        effort = case.get("reasoning_effort")
        prompt = enc.encode_messages(msgs, thinking_mode="thinking" if case.get("thinking") else "chat",
                                     reasoning_effort=effort if effort in ("max", "high") else None)
        encode.append(dict(case, prompt=prompt))

    parse = []
    for case in PARSE_CASES:
        mode = "thinking" if case["thinking"] else "chat"
        # The last message after a user turn: rendered with its reasoning, closed by EOS.
        text = enc.render_message(1, [{"role": "user", "content": "q"}, case["message"]], thinking_mode=mode)
        got = enc.parse_message_from_completion_text(text, thinking_mode=mode)
        assert text.endswith(enc.eos_token)
        parse.append({"name": case["name"], "thinking": case["thinking"],
                      "completion": text[:-len(enc.eos_token)],
                      "content": got["content"], "reasoning_content": got["reasoning_content"],
                      "tool_calls": [{"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
                                     for tc in got["tool_calls"]]})

    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"generated_by": "tools/make_openai_fixtures.py with DeepSeek's encoding_dsv4.py",
                   "encode": encode, "parse": parse}, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
