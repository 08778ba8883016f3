"""Functions the launcher-API tests run in worker processes (standard library only, so the workers start fast)."""

import os


def rank_and_world(offset: int) -> tuple[int, int, int]:
    return int(os.environ["RANK"]) + offset, int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def fail_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise KeyError("no such shard")


def fail_first_attempt() -> int:
    restart = int(os.environ["RESTART_COUNT"])
    if restart == 0 and os.environ["RANK"] == "0":
        raise RuntimeError("first attempt")
    return restart
