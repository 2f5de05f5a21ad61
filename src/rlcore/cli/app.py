"""The ``rlcore`` command. Sub-commands import what they need when they run."""

from __future__ import annotations

import typer

from rlcore.cli.backends_cmd import backends_app
from rlcore.cli.config_cmd import config_app
from rlcore.cli.doctor_cmd import doctor
from rlcore.cli.examples_cmd import examples_app
from rlcore.cli.kinds_cmd import algorithms_app, environments_app
from rlcore.cli.run_cmd import RunCommand, run

app = typer.Typer(
    help="rlcore: plugin-based RL post-training backends.", no_args_is_help=True, pretty_exceptions_enable=False
)
app.add_typer(algorithms_app(), name="algorithms")
app.add_typer(backends_app, name="backends")
app.add_typer(config_app, name="config")
app.add_typer(environments_app(), name="environments")
app.add_typer(examples_app, name="examples")
app.command("run", cls=RunCommand)(run)
app.command("doctor")(doctor)


def main() -> None:
    app()
