"""Alembic environment: the archive hands over its open connection; by hand, pass -x url=..."""

from alembic import context
from sqlalchemy import create_engine

from agentmem.tiers.schema import Base, include_object

config = context.config
connection = config.attributes.get("connection")


def _run(conn) -> None:
    context.configure(connection=conn, target_metadata=Base.metadata, render_as_batch=conn.dialect.name == "sqlite",
                      include_object=include_object)
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit("pass the database: alembic -x url=sqlite:///... upgrade head")
    with create_engine(url).connect() as conn:
        _run(conn)
