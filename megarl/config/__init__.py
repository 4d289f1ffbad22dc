"""megarl configuration: structured schema, loading with CLI overrides, validation.

Public API: ``load_config(path, overrides)``, ``validate_config(cfg)``, ``to_yaml(cfg)``,
``plan_task_groups(cfg)``, ``ConfigError`` and the ``MegaRLConfig`` schema.
"""
from megarl.config.errors import ConfigError
from megarl.config.loader import load_config, to_yaml
from megarl.config.schema import MegaRLConfig
from megarl.config.validate import plan_task_groups, validate_config

__all__ = ["ConfigError", "MegaRLConfig", "load_config", "plan_task_groups", "to_yaml",
           "validate_config"]
