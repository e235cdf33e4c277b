"""A checkpoint's configuration as the families read it."""

from __future__ import annotations


class Config(dict):
    """A checkpoint's config.json (the text config for multimodal layouts) with attribute access."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no field {name!r}") from None

    def get_rope(self, default_theta: float = 10000.0) -> dict:
        """transformers 5 `rope_parameters`, falling back to the older flat fields."""
        params = dict(self.get("rope_parameters") or self.get("rope_scaling") or {})
        params.setdefault("rope_theta", self.get("rope_theta", default_theta))
        if "partial_rotary_factor" in self:
            params.setdefault("partial_rotary_factor", self["partial_rotary_factor"])
        params.setdefault("rope_type", params.pop("type", "default"))
        return params
