"""Checkpoint IDs and names: generation and validation. Nothing unvalidated becomes a path."""

import re
import secrets
from datetime import datetime, timedelta, timezone

from ckpt.errors import InvalidReference

ID_RE = re.compile(r"^[0-9]{8}-[0-9]{6}-[0-9]{3}-[0-9a-f]{6}$")
ID_PREFIX_RE = re.compile(r"^[0-9][0-9a-f-]{3,25}$")
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,63}$")


def new_id(now: datetime | None = None) -> str:
    """UTC time to the millisecond, then 24 random bits: IDs sort by creation time."""
    now = now or datetime.now(timezone.utc)
    return f"{now:%Y%m%d-%H%M%S}-{now.microsecond // 1000:03d}-{secrets.token_hex(3)}"


def is_id(text: str) -> bool:
    return bool(ID_RE.match(text))


def check_id(text: str) -> str:
    if not is_id(text):
        raise InvalidReference(f"'{text}' is not a checkpoint ID",
                               hint="IDs look like 20261130-230102-123-3fa9c1; see 'ckpt list'")
    return text


# How far from now the time in an ID chosen by its caller (`ckpt dump --id`) may be: IDs sort by
# creation time, and 'latest' is the last of them.
NEW_ID_SKEW = timedelta(minutes=10)


def check_new_id(text: str, now: datetime | None = None) -> str:
    """An ID for a checkpoint about to be made, chosen by its caller: well-formed, and made
    (by new_id) within NEW_ID_SKEW of now, so that it sorts where a checkpoint made now does."""
    check_id(text)
    made = datetime.strptime(text[:19], "%Y%m%d-%H%M%S-%f").replace(tzinfo=timezone.utc)
    if abs((now or datetime.now(timezone.utc)) - made) > NEW_ID_SKEW:
        raise InvalidReference(f"checkpoint ID {text} was not made just now (its time is {made:%Y-%m-%d %H:%M:%S} UTC)",
                               hint="give an ID from ckpt.store.ids.new_id(), made just before the dump")
    return text


def check_name(text: str) -> str:
    if not NAME_RE.match(text):
        raise InvalidReference(
            f"invalid checkpoint name '{text}'",
            hint="use 1-64 letters, digits, '.', '_' or '-', starting with a letter")
    return text


def classify_reference(ref: str) -> str:
    """'latest', 'id', 'prefix' or 'name'; raises InvalidReference for anything unsafe."""
    if ref == "latest":
        return "latest"
    if is_id(ref):
        return "id"
    if ID_PREFIX_RE.match(ref):
        return "prefix"
    if NAME_RE.match(ref):
        return "name"
    raise InvalidReference(f"'{ref}' is neither a checkpoint ID nor a name",
                           hint="use an ID or name from 'ckpt list', or 'latest'")
