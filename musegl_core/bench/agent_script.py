"""The synthetic coding-agent conversation that ``musegl bench --api`` replays.

It stands in for what Claude Code and Codex CLI send (``spec/agent-apis.md``):
a long system prompt (standing rules, then project notes made of deterministic
filler, sized in tokens of the served tokenizer) and about ten tool
definitions, then turns that each add a user message or, after a tool call, a
tool result. Everything is a pure function of the seed and the indices, so
the three wire formats (:mod:`musegl_core.bench.cli_wire`) carry the same
conversation.
"""

from __future__ import annotations

from typing import Any

import attrs

from musegl_core.bench.workloads import filler_text

_RULES = """\
You are an interactive coding agent working in the user's repository. Use the tools below to read, search,
edit and run code; answer in short, plain sentences. Before you change a file, read it. Prefer editing an
existing file over writing a new one, and never create documentation files unless asked. Keep the user's
style: imports, naming, formatting and error handling as the surrounding code has them. When you run a
command that changes the system, say what it does first. Do not guess paths: list or search. When a test
fails, read the failure before you change anything, and fix the cause, not the symptom. Report what you did
and what you could not do. Commit only when the user asks. Never print secrets or credentials."""

#: (name, description, {parameter: (json type, description)}, required) in Claude Code's tool set.
_CLAUDE_TOOLS: tuple[tuple[str, str, dict[str, tuple[str, str]], tuple[str, ...]], ...] = (
    ("Bash", "Executes a shell command in a persistent shell session with an optional timeout. Use it for "
     "git, builds and tests; quote paths with spaces; do not use it to read or search files.",
     {"command": ("string", "The command to execute"), "timeout": ("number", "Optional timeout in milliseconds"),
      "description": ("string", "What the command does, in five to ten words")}, ("command",)),
    ("Glob", "Fast file pattern matching: returns the paths matching a glob pattern, newest first.",
     {"pattern": ("string", "The glob pattern, e.g. **/*.py"), "path": ("string", "The directory to search in")},
     ("pattern",)),
    ("Grep", "Searches file contents with regular expressions; filter with glob or type; returns matching "
     "lines, files or counts.",
     {"pattern": ("string", "The regular expression"), "path": ("string", "File or directory to search"),
      "glob": ("string", "Glob filter for file names"), "output_mode": ("string", "content, files_with_matches or count")},
     ("pattern",)),
    ("Read", "Reads a file from the local filesystem, with line numbers; long files may be read in parts.",
     {"file_path": ("string", "The absolute path of the file"), "offset": ("number", "The line to start at"),
      "limit": ("number", "The number of lines to read")}, ("file_path",)),
    ("Edit", "Performs an exact string replacement in a file. The file must have been read first; old_string "
     "must be unique in the file unless replace_all is set.",
     {"file_path": ("string", "The absolute path of the file"), "old_string": ("string", "The text to replace"),
      "new_string": ("string", "The replacement text"), "replace_all": ("boolean", "Replace every occurrence")},
     ("file_path", "old_string", "new_string")),
    ("Write", "Writes a file to the local filesystem, overwriting it if it exists. Read an existing file first.",
     {"file_path": ("string", "The absolute path of the file"), "content": ("string", "The content to write")},
     ("file_path", "content")),
    ("TodoWrite", "Creates and updates a structured task list for the current session to track progress.",
     {"todos": ("array", "The updated todo list")}, ("todos",)),
    ("WebFetch", "Fetches a URL and processes its content with a prompt.",
     {"url": ("string", "The URL to fetch"), "prompt": ("string", "What to extract from the page")}, ("url", "prompt")),
    ("NotebookEdit", "Replaces, inserts or deletes one cell of a Jupyter notebook.",
     {"notebook_path": ("string", "The absolute path of the notebook"), "cell_id": ("string", "The cell to edit"),
      "new_source": ("string", "The new source of the cell")}, ("notebook_path", "new_source")),
    ("Task", "Launches a sub-agent for a complex, multi-step task and returns its final report.",
     {"description": ("string", "A short description of the task"), "prompt": ("string", "The task itself"),
      "subagent_type": ("string", "The kind of agent")}, ("description", "prompt")),
)

#: Codex CLI's function tools, same layout as above.
_CODEX_TOOLS: tuple[tuple[str, str, dict[str, tuple[str, str]], tuple[str, ...]], ...] = (
    ("exec_command", "Runs a command in a PTY, returning output or a session id for ongoing interaction.",
     {"cmd": ("string", "Shell command to execute"), "workdir": ("string", "Working directory"),
      "yield_time_ms": ("number", "How long to wait for output"), "max_output_tokens": ("number", "Output cap")},
     ("cmd",)),
    ("write_stdin", "Writes characters to an existing exec session and returns recent output.",
     {"session_id": ("number", "The exec session"), "chars": ("string", "Bytes to write")}, ("session_id",)),
    ("update_plan", "Updates the task plan: a short list of steps, each pending, in_progress or completed.",
     {"explanation": ("string", "Why the plan changed"), "plan": ("array", "The steps")}, ("plan",)),
    ("view_image", "Attaches a local image file to the conversation.",
     {"path": ("string", "Local filesystem path to an image file")}, ("path",)),
    ("list_mcp_resources", "Lists resources provided by MCP servers.",
     {"server": ("string", "Optional MCP server name"), "cursor": ("string", "Pagination cursor")}, ()),
    ("read_mcp_resource", "Reads one resource of an MCP server.",
     {"server": ("string", "The MCP server"), "uri": ("string", "The resource URI")}, ("server", "uri")),
    ("shell_command", "Runs a shell command and returns its output (non-interactive).",
     {"command": ("string", "The command"), "workdir": ("string", "Working directory"),
      "timeout_ms": ("number", "Timeout")}, ("command",)),
    ("search_files", "Searches the workspace for a regular expression.",
     {"pattern": ("string", "The regular expression"), "path": ("string", "Where to search")}, ("pattern",)),
    ("read_file", "Reads a text file of the workspace with line numbers.",
     {"path": ("string", "The file"), "offset": ("number", "First line"), "limit": ("number", "Lines")}, ("path",)),
)

#: Codex's freeform patch tool: a ``custom`` tool whose input is a sentence of this Lark grammar.
APPLY_PATCH_GRAMMAR = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change+
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF
%import common.LF
"""

APPLY_PATCH_DESCRIPTION = "Edits files with a patch in the apply_patch format (freeform: the input is the patch)."


@attrs.frozen
class Tool:
    """One tool definition, independent of the wire format."""

    name: str
    description: str
    parameters: dict[str, Any]


def _tools(table) -> tuple[Tool, ...]:
    return tuple(
        Tool(name, description, {
            "type": "object",
            "properties": {key: {"type": kind, "description": text} for key, (kind, text) in params.items()},
            "required": list(required),
            "additionalProperties": False,
        })
        for name, description, params, required in table
    )


CLAUDE_TOOLS = _tools(_CLAUDE_TOOLS)
CODEX_TOOLS = _tools(_CODEX_TOOLS)


def system_text(seed: int, workspace: str, *, words: int) -> str:
    """The long system prompt: the workspace's name, the standing rules, then project notes up to
    about ``words`` words. The name comes first so that two conversations (or a conversation and
    its Chat Completions reference) share no prompt prefix: each turn 1 is a full prefill."""
    head = f"Workspace: /work/{workspace}\n\n{_RULES}"
    notes = filler_text(seed, "agent-system", words=max(words - len(head.split()), 1))
    return f"{head}\n\n# Project notes\n\n{notes}"


def user_text(seed: int, conversation: int, turn: int, *, words: int) -> str:
    """The user's message opening ``turn`` (1-based) of ``conversation``."""
    return filler_text(seed, "agent-user", conversation, turn, words=words)


def tool_output(seed: int, conversation: int, turn: int, call: int, *, words: int) -> str:
    """The (synthetic) output the client returns for the ``call``-th tool call of the previous turn."""
    return filler_text(seed, "agent-tool", conversation, turn, call, words=words)
