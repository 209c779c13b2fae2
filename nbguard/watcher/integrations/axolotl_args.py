"""The YAML keys of nbguard's axolotl plugin, as the pydantic model axolotl merges into its config schema.

axolotl imports this module by the path the plugin's ``get_input_args`` names; pydantic comes with axolotl,
so nothing else imports it (nbguard itself does not depend on pydantic).
"""
from __future__ import annotations

from pydantic import BaseModel


class NbguardArgs(BaseModel):
    """``nbguard_policy``: warn (default), skip, stop or rewind; ``nbguard_rewind_every``: optimizer steps
    between rewind's snapshots (50 unless set)."""

    nbguard_policy: str | None = None
    nbguard_rewind_every: int | None = None
