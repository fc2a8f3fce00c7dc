from typing import Annotated

import typer

from ckpt.cli.options import NO_FLAGS, REPORTING, SharedFlags, open_store, shared_flags
from ckpt.cli.output import emit_json, human_bytes, stderr
from ckpt.commands.cache_warm import WarmReport, warm

HELP = """The local cache of a store in S3 (CKPT_CACHE, capped by CKPT_CACHE_SIZE).

Examples:

  ckpt cache warm agent --store s3://my-bucket/agents
"""

WARM_HELP = """Pull into this host's cache everything a restore of the checkpoints reads from the bucket.

Run on a standby host: the index files, the checkpoint's image files and the packs holding its
memory are downloaded (in parallel, each checked before it enters the cache), only those the
cache lacks, so that a failover restore here reads its checkpoint at local speed and downloads
no content (manifests and locks are still asked of the bucket). Run again, it downloads only
what newer checkpoints added.

REF is what 'ckpt restore' takes: a checkpoint ID (or a unique prefix), a name (the newest
checkpoint with it), 'latest', or a group checkpoint (all its members). Several REFs are warmed
together (a standby for several agents). What they need must fit the cache's cap with the room
eviction leaves (90% of CKPT_CACHE_SIZE): if not, a one-line error before anything more is
downloaded (exit code 2). The copies warmed are marked as just used: eviction takes them last.

To keep a standby warm as new checkpoints arrive, run it from cron (flock -n skips a run while
the previous one still downloads):

\b
  * * * * * root flock -n /run/ckpt-warm.lock ckpt cache warm agent --store s3://my-bucket/agents -q

Examples:

  ckpt cache warm agent --store s3://my-bucket/agents

  ckpt cache warm agent web-frontend --store s3://my-bucket/agents --json

  ckpt cache warm 20261130-230102-123-3fa9c1 --store s3://my-bucket/agents
"""

cache_app = typer.Typer(help=HELP, no_args_is_help=True, rich_markup_mode=None)


@cache_app.command("warm", help=WARM_HELP)
@shared_flags(REPORTING)
def warm_command(
    refs: Annotated[list[str], typer.Argument(metavar="REF...", help="Checkpoint IDs or names (a name: its newest), "
                                                                     "or group checkpoints.", show_default=False)],
    flags: SharedFlags = NO_FLAGS,
) -> None:
    reporter = flags.reporter()
    try:
        report = warm(open_store(flags.store, create=False, reporter=reporter), refs, reporter)
    finally:
        reporter.close()
    if flags.json_out:
        emit_json(report.to_json())
    elif not flags.quiet:
        _print_report(report)


def _print_report(report: WarmReport) -> None:
    ids = ", ".join(m.id for m in report.checkpoints)
    stderr.print(f"{ids}: {report.blobs} blobs ({human_bytes(report.bytes)}) in the cache: {report.fetched_blobs} "
                 f"downloaded ({human_bytes(report.fetched_bytes)}) in {report.duration_ms / 1000:.1f} s, "
                 f"{report.cached_blobs} there already")

def register(app: typer.Typer) -> None:
    app.add_typer(cache_app, name="cache")
