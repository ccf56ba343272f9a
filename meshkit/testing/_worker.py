"""Child-process entry point of ``meshkit.testing.run_processes``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import sys
from pathlib import Path
from typing import Any


def _load(module_name: str, file: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError:
        if not file:
            raise
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"Cannot load module {module_name!r} from {file!r}.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(Path(file).parent))  # its sibling modules import, as in a script
    spec.loader.exec_module(module)
    return module


def main(payload: str) -> None:
    import meshkit.distributed

    meshkit.distributed.initialize()
    (module_name, file, qualname), args = pickle.loads(Path(payload).read_bytes())
    target: Any = _load(module_name, file)
    for part in qualname.split("."):
        target = getattr(target, part)
    result = target(*args)
    Path(os.environ["MESHKIT_RESULT"]).write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
