"""Why a graph-mode bucket failed, in one line: an error's first (and last) line (``error_lines``) and the
op whose lowering raised it (``failing_op``)."""

from __future__ import annotations

# The cache's own modules: their frames (the cache calling JAX) are never where an error came from.
_CACHE_FILES = ("graph/bucket_plan.py", "graph/compiled_buckets.py", "graph/scheduling.py",
               "graph/executable_cache.py")


def error_lines(error: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of ``error``'s message, plus its last line when that differs (a callback's or
    a compiler's message often ends with the exception that caused it), at most ``limit`` characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = "; ".join(dict.fromkeys(lines[:1] + lines[-1:])) if lines else "(no message)"
    text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def failing_op(error: BaseException) -> str:
    """The op whose lowering raised ``error``, as far as JAX's lowering frames show it: the innermost
    equation's primitive (with its ``name`` when it has one, e.g. a Pallas call's) and the innermost
    source location among the equations being lowered (the kernel or op function that emitted it), e.g.
    "mpmd_map from commit_kv_kernel (pallas_kernels/commit_kv.py:204)"; for an error raised while
    tracing, the innermost function outside JAX that raised it. "" when neither is found (a run-time
    failure, or JAX's internals changed): this reads frame locals and never raises."""
    try:
        import traceback

        from jax._src import source_info_util
        primitive, where = "", ""
        for frame, _ in traceback.walk_tb(error.__traceback__):
            eqn = frame.f_locals.get("eqn")
            if eqn is None or not hasattr(eqn, "primitive") or not hasattr(eqn, "source_info"):
                continue
            name = eqn.params.get("name") if isinstance(getattr(eqn, "params", None), dict) else None
            primitive = eqn.primitive.name + (f" {name!r}" if isinstance(name, str) and name not in ("", "anonymous")
                                              else "")
            frame_info = source_info_util.user_frame(eqn.source_info.traceback)
            if frame_info is not None:
                path = "/".join(frame_info.file_name.replace("\\", "/").split("/")[-2:])
                where = f"{frame_info.function_name} ({path}:{frame_info.start_line})"
        if primitive:
            return primitive + (f" from {where}" if where else "")
        # Raised while tracing (e.g. a kernel refusing its inputs): the innermost frame outside JAX.
        for summary in reversed(traceback.extract_tb(error.__traceback__)):
            path = summary.filename.replace("\\", "/")
            if "/jax/" not in path and "/jaxlib/" not in path and not path.endswith(_CACHE_FILES):
                return f"{summary.name} ({'/'.join(path.split('/')[-2:])}:{summary.lineno})"
        return ""
    except Exception:  # noqa: BLE001 - best effort: the reason is still recorded without it
        return ""
