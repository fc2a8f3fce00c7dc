from typing import Annotated, Optional

import typer

from ckpt.cli.options import (JsonOption, PasswordFileOption, QuietOption, StoreOption, invocation, store_root,
                              use_password_file)
from ckpt.cli.output import emit_json, stderr
from ckpt.commands.init import init

HELP = """Create a checkpoint store, in a directory or in an S3 bucket.

A store in a bucket (s3://BUCKET/PREFIX) is always encrypted: every object in it is encrypted
and authenticated on this machine with a key that only the password unlocks. Keep the password:
without it the checkpoints cannot be read. A local store is encrypted only with --encrypt
(`ckpt dump` creates a plain local store by itself).

The password comes from CKPT_PASSWORD, CKPT_PASSWORD_FILE or --password-file (its first line),
else it is asked on the terminal. The S3 server and credentials are taken as every AWS tool
takes them: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/config.

Examples:

  ckpt init s3://backups/agents --password-file /root/.ckpt-password

  AWS_ENDPOINT_URL=http://127.0.0.1:8333 ckpt init s3://ckpt

  ckpt init --store /srv/ckpt --encrypt
"""


def register(app: typer.Typer) -> None:
    @app.command("init", help=HELP)
    def init_command(
        location: Annotated[Optional[str], typer.Argument(
            metavar="[DIR|s3://BUCKET/PREFIX]", help="The store to create [default: --store, CKPT_STORE].")] = None,
        encrypt: Annotated[bool, typer.Option("--encrypt", help="Encrypt a local store (remote ones always are).")]
        = False,
        password_file: PasswordFileOption = None,
        store: StoreOption = None,
        json_out: JsonOption = False,
        quiet: QuietOption = False,
    ) -> None:
        use_password_file(password_file)
        run = invocation()
        result = init(store_root(location if location is not None else store), run.settings(), run.passwords(),
                      encrypt=encrypt)
        if json_out:
            emit_json(result.to_json())
            return
        if not quiet:
            if result.encrypted:
                stderr.print(f"created an encrypted ckpt store at {result.location} (key {result.key_id}); "
                             "keep its password: without it no checkpoint in it can be read")
            else:
                stderr.print(f"created a ckpt store at {result.location}")
            if result.local_dir != result.location:
                stderr.print(f"its local side (staging, logs, schedules, cache) is {result.local_dir}")
        print(result.location)
