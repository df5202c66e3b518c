"""Delivery analytics over spool logs on Apache Spark (the ``[analytics]`` extra).

``events.py`` turns segments into rows with the spool's own decoder (no Spark needed);
``source.py`` is the Spark data source ``spool`` built on it; ``tables.py`` derives the
``events`` and ``recipients`` tables; ``reports.py`` the reports and their HTML page;
``bounces.py`` classifies failures by the rules in ``bounce_rules.json``. docs/analytics.md
tells how to run it locally and on a cluster.

The core package never imports this one: a spool runs without Spark installed.
"""
