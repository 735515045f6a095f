"""Tools that attack the runtime that calls them (issue 29, item 3), for the tool isolation tests and
the soak. Each is a plain `Tool` loaded from a YAML config by its module path, so by default it runs
in a tool worker process; run inline, each of them ends or freezes the whole runtime.

- `exit`: `os._exit(7)` — the process ends at once, no cleanup, no message;
- `gil_hog`: `sum(range(n))` — one C call that never releases the GIL (36 s for 2e9 on one core);
- `spin_thread`: starts a non-daemon thread that spins forever, then returns (the process can never exit);
- `fork`: forks a child that sleeps holding stdout/stderr open, then returns;
- `echo`: a well-behaved tool, to show the pool's workers serve the calls that follow.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from agentloop.tools import Tool, ToolContext
from agentloop.tools.builtin.calculator import evaluate, format_number  # imported with the tool, not in its first call

_TEXT = {"type": "object", "properties": {"text": {"type": "string"}}}


class ExitTool(Tool):
    name, description, parameters = "exit", "Exits the process.", _TEXT

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        os._exit(7)


class GilHogTool(Tool):
    name, description, parameters = "gil_hog", "Holds the GIL in one long C call.", _TEXT

    def __init__(self, n: int = 2_000_000_000) -> None:
        self.n = n

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return str(sum(range(self.n)))


class SpinThreadTool(Tool):
    name, description, parameters = "spin_thread", "Leaves a non-daemon thread spinning.", _TEXT

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        def spin() -> None:
            while True:
                pass

        threading.Thread(target=spin, name="spinner", daemon=False).start()
        return "spinning"


class ForkTool(Tool):
    name, description, parameters = "fork", "Forks a child that outlives the call.", _TEXT

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        pid = os.fork()
        if pid == 0:  # the child: keeps the inherited stdout/stderr open for an hour
            time.sleep(3600)
            os._exit(0)
        return f"forked {pid}"


class EchoTool(Tool):
    name, description, parameters = "echo", "Says the text back, with its process id.", _TEXT

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return f"{arguments.get('text', '')} pid={os.getpid()}"


class CountingTool(Tool):
    """Per-trajectory state in `context.state` (a process tool with state hooks: pinned to a worker)."""

    name, description, parameters = "count", "Counts its calls in this trajectory.", _TEXT

    async def create_state(self, context: ToolContext) -> None:
        context.state["count"] = 0

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        context.state["count"] += 1
        if arguments.get("text") == "exit":
            os._exit(3)
        return f"{context.state['count']} pid={os.getpid()}"


class RouletteTool(Tool):
    """Stands in for the calculator (a YAML `tool_schema` gives it the calculator's name and schema):
    each trajectory's calls all make the same attack, picked from `attacks` by its id ("calculate"
    answers like the calculator would, so that trajectory behaves)."""

    name, description, parameters = "roulette", "Attacks, or calculates.", _TEXT

    def __init__(self, attacks: list[str] | None = None, gil_n: int = 2_000_000_000) -> None:
        self.attacks = attacks or ["exit", "gil_hog", "spin_thread", "fork", "calculate"]
        self.tools = {"exit": ExitTool(), "gil_hog": GilHogTool(gil_n), "spin_thread": SpinThreadTool(),
                      "fork": ForkTool()}

    def attack_for(self, trajectory_id: str) -> str:
        import zlib

        return self.attacks[zlib.crc32(trajectory_id.encode()) % len(self.attacks)]

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        attack = self.attack_for(context.trajectory_id)
        if attack == "calculate":
            return format_number(evaluate(str(arguments.get("expression", ""))))
        return await self.tools[attack].execute(arguments, context)


class ChaosWorkerCalculator(Tool):
    """The soak's calculator for the calls drawn for a process fault (`arguments["_chaos"]`, set by the
    soak, which counts the faults): makes that attack in its worker process, else calculates."""

    name, description, parameters = "calculator_in_worker", "The calculator, in a tool worker.", _TEXT
    ATTACKS = {"process_exit": ExitTool, "gil_hog": GilHogTool, "spin_thread": SpinThreadTool, "fork_child": ForkTool}

    def __init__(self, gil_n: int = 2_000_000_000) -> None:
        self.gil_n = gil_n

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        kind = arguments.pop("_chaos", None)
        if kind in self.ATTACKS:
            tool = GilHogTool(self.gil_n) if kind == "gil_hog" else self.ATTACKS[kind]()
            return await tool.execute(arguments, context)
        return format_number(evaluate(str(arguments.get("expression", ""))))


class IsolatedEcho(EchoTool):
    """`echo` that asks for a worker process itself (a tool object passed in code is inline by default)."""

    isolation = "process"


class DaemonHelperTool(Tool):
    """Well-behaved: starts (once) a daemon background thread, as client libraries do; not a leftover."""

    name, description, parameters = "daemon_helper", "Keeps a daemon helper thread.", _TEXT
    _started = False

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        if not DaemonHelperTool._started:
            DaemonHelperTool._started = True
            threading.Thread(target=time.sleep, args=(3600,), name="helper", daemon=True).start()
        return f"ok pid={os.getpid()}"
