"""Command-line help shared by meshkit's tools and the recipes."""

from __future__ import annotations

import argparse
import copy


class HelpWithDefaults(argparse.HelpFormatter):
    """Help that ends each option with its default, where it has one to show (not for
    a flag that is off, nor where the help already says its default); an option
    without help shows its default alone."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = _default_text(action)
        if not shown or "default" in text:
            return text
        return f"{text} ({shown})".lstrip()

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and (shown := _default_text(action)):
            action = copy.copy(action)
            action.help = f"({shown})"
        return super()._format_action(action)


def _default_text(action: argparse.Action) -> str:
    """``default: 128``, or ``""`` where there is nothing to show."""
    default = action.default
    if default is None or default is False or default == argparse.SUPPRESS:  # 0 is shown
        return ""
    shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
    return f"default: {shown.replace('%', '%%')}"
