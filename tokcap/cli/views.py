"""Rich renderings of command results; each takes the same dict that ``--json`` prints."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["render_demo", "render_rollout", "render_staging", "render_store"]


def _count(value: int | float) -> str:
    return f"{value:,.0f}" if isinstance(value, int) or value >= 100 else f"{value:,.1f}"


def render_demo(report: dict[str, Any], console: Console) -> None:
    """The demo summary: what ran, what trained, what was masked and why, and where the store is."""
    totals = report["totals"]
    settings = report["settings"]
    transport = report["transport"]
    where = {
        "file": "file store (no broker)",
        "file-staging": "file store, engine-side staging: staging sink, ledger, staging source (no broker)",
    }.get(transport, f"Kafka {report['bootstrap']}, topic {report['topic']}")
    table = Table(title="tokcap demo", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("transport", where)
    if transport == "kafka":
        table.add_row(
            "model servers", f"{report['servers']} Kafka sinks, one materializer feeding the trainer"
        )
    table.add_row(
        "workload",
        f"{settings['rollouts']} rollouts x {settings['turns']} turns, prompt ~{settings['prompt_tokens']} tokens, "
        f"{settings['concurrency']} concurrent",
    )
    table.add_row("rollouts trained", f"{totals['trained']} of {totals['rollouts']}")
    reasons = ", ".join(f"{reason} x{count}" for reason, count in totals["mask_reasons"].items())
    table.add_row("rollouts masked", f"{totals['masked']}" + (f" ({reasons})" if reasons else ""))
    table.add_row(
        "retired",
        f"{totals['retired']} snapshots dropped, {totals['kept_as_evidence']} rollouts kept as evidence",
    )
    table.add_row(
        "calls",
        f"{totals['calls_captured']} captured of {totals['calls_attempted']} attempted; "
        f"{totals['calls_lost']} lost, {totals['writes_failed']} failed writes, "
        f"{totals['attempts_cancelled']} cancelled, {totals['samples_discarded']} discarded samples, "
        f"{totals['late_writes']} late writes",
    )
    table.add_row(
        "tokens",
        f"{_count(totals['prompt_tokens'])} prompt + {_count(totals['generated_tokens'])} generated captured; "
        f"{_count(totals['trained_tokens'])} in trained sequences",
    )
    table.add_row(
        "throughput",
        f"{_count(totals['calls_per_second'])} calls/s, {_count(totals['tokens_per_second'])} tokens/s "
        f"(capture {report['capture_seconds']:.2f} s, finalize {report['finalize_seconds']:.2f} s)",
    )
    kept = "kept" if report["store_kept"] else "removed (pass --keep-dir to keep it)"
    table.add_row("store", f"{report['store_dir']} — {kept}")
    console.print(table)
    faults = [r for r in report["rollouts"] if r["fault"]]
    if faults:
        fault_table = Table(title="injected faults", title_justify="left")
        for column in ("rollout", "fault", "verdict", "retired", "late write"):
            fault_table.add_column(column)
        for rollout in faults:
            verdict = "masked: " + ", ".join(rollout["mask_reasons"]) if rollout["masked"] else "trained"
            fault_table.add_row(
                rollout["rollout_id"],
                rollout["fault"],
                verdict,
                "yes" if rollout["retired"] else "no (kept)",
                rollout["late_write"] or "",
            )
        console.print(fault_table)
    if report["store_kept"]:
        console.print(f"next: tokcap inspect {report['store_dir']} [ROLLOUT]")
        if transport == "kafka":
            run = str(report["topic"]).removeprefix("tokcap.")
            console.print(
                f"      tokcap log --bootstrap {report['bootstrap']} --run {run} --rollout demo-00004"
            )


def render_store(description: dict[str, Any], console: Console) -> None:
    """The table of rollouts in a store directory."""
    rollouts = description["rollouts"]
    table = Table(title=f"{description['store_dir']}: {len(rollouts)} rollouts", title_justify="left")
    for column in (
        "rollout",
        "state",
        "incomplete",
        "entries",
        "prompt tok",
        "generated tok",
        "version",
        "rejections",
        "staged",
        "ledger",
    ):
        table.add_column(column, justify="right" if column not in {"rollout", "state"} else "left")
    for row in rollouts:
        table.add_row(
            row["rollout_id"],
            row["state"],
            "yes" if row["incomplete"] else "",
            str(row["entries"]),
            str(row["prompt_tokens"]),
            str(row["generated_tokens"]),
            str(row["version"]),
            str(row["rejections"] or ""),
            str(row.get("staged") or ""),
            _ledger_cell(row),
        )
    console.print(table)


def _ledger_cell(row: dict[str, Any]) -> str:
    rows, failures = row.get("ledger_rows", 0), row.get("ledger_failures", 0)
    if not rows and not failures:
        return ""
    return f"{rows}" + (f" +{failures} failed" if failures else "")


def render_staging(detail: dict[str, Any], console: Console) -> None:
    """A rollout's staged calls and ledger rows (engine-side staging), when it has any."""
    if not detail.get("staged") and not detail.get("ledger") and not detail.get("ledger_failures"):
        return
    staged = Table(title=f"staged calls ({len(detail['staged'])})", title_justify="left")
    for column in (
        "staging key",
        "parent",
        "prompt tok",
        "generated tok",
        "cum len",
        "extras B",
        "attachments",
    ):
        staged.add_column(column)
    for row in detail["staged"]:
        attachments = ", ".join(f"{name} {size} B" for name, size in row["attachments"].items())
        staged.add_row(
            row["staging_key"],
            row["parent_call_id"] or "-",
            str(row["prompt_tokens"]),
            str(row["generated_tokens"]),
            str(row["cum_len"]),
            "" if row["extras_bytes"] is None else str(row["extras_bytes"]),
            attachments,
        )
    console.print(staged)
    ledger = Table(title=f"ledger rows ({len(detail['ledger'])})", title_justify="left")
    for column in ("call", "parent", "staging key", "cum len", "response id"):
        ledger.add_column(column)
    for row in detail["ledger"]:
        ledger.add_row(
            row["model_call_id"],
            row["parent_call_id"] or "-",
            row["staging_key"],
            str(row["cum_len"]),
            row["response_id"],
        )
    console.print(ledger)
    for failure in detail["ledger_failures"]:
        console.print(f"ledger failure: call {failure['model_call_id']}: {failure['reason']}")
    console.print(f"staging verdict: {detail['staging_verdict']}")


def render_rollout(detail: dict[str, Any], console: Console) -> None:
    """One rollout: its state, entries, intents, reasons, rejections, chain and the mask verdict."""
    console.print(
        f"[bold]{detail['rollout_id']}[/bold]  state {detail['state']}  version {detail['version']}  "
        f"snapshot {detail['snapshot_id'] or '-'}  incomplete {'yes' if detail['incomplete'] else 'no'}"
    )
    if not detail["entries"] and (
        detail.get("staged") or detail.get("ledger") or detail.get("ledger_failures")
    ):
        render_staging(detail, console)
        return
    if detail["last_position"]:
        position = detail["last_position"]
        console.print(
            f"last applied log position: {position['topic']} p{position['partition']} @{position['offset']}"
        )
    entries = Table(title=f"entries ({len(detail['entries'])})", title_justify="left")
    for column in ("call", "prompt tok", "generated tok", "model"):
        entries.add_column(column)
    for entry in detail["entries"]:
        entries.add_row(
            entry["model_call_id"],
            str(entry["prompt_tokens"]),
            str(entry["generated_tokens"]),
            entry["model"],
        )
    console.print(entries)
    if detail["intents"]:
        console.print(
            "intents: " + ", ".join(f"{call} ({op})" for call, op in sorted(detail["intents"].items()))
        )
    if detail["dangling_intents"]:
        console.print("dangling at freeze: " + ", ".join(detail["dangling_intents"]))
    for mark in detail["incomplete_reasons"]:
        call = mark.get("model_call_id") or "-"
        console.print(f"incomplete: call {call}: {mark.get('reason') or '(no reason given)'}")
    for rejection in detail["rejections"]:
        position = rejection.get("position")
        where = f" at p{position['partition']} @{position['offset']}" if position else ""
        console.print(
            f"rejected after freeze: {rejection['event_type']} of call {rejection['model_call_id'] or '-'}{where}"
        )
    build = detail["build"]
    if build is not None and build["main_chain"] is not None:
        chain = build["main_chain"]
        steps = " -> ".join(
            f"{link['model_call_id']} (+{link['context_tokens']} ctx, {link['generated_tokens']} gen)"
            for link in chain["links"]
        )
        console.print(f"main chain: {steps}")
        if build["discarded_retries"]:
            console.print("discarded retries: " + ", ".join(build["discarded_retries"]))
        if build["branch_chain_ids"]:
            console.print("branches: " + ", ".join(build["branch_chain_ids"]))
        if build["quarantined_call_ids"]:
            console.print("quarantined: " + ", ".join(build["quarantined_call_ids"]))
    verdict = detail["verdict"]
    if verdict is None:
        console.print("verdict: retired (records removed, fence kept)")
    elif verdict["masked"]:
        console.print("verdict: [bold red]masked[/bold red]: " + ", ".join(verdict["mask_reasons"]))
    else:
        console.print(
            f"verdict: [bold green]trainable[/bold green], {verdict['sequence_tokens']} tokens in the sequence"
        )
    render_staging(detail, console)
