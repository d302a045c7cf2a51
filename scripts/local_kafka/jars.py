"""The broker's runtime jars, fetched once from Maven Central into the shared cache."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .errors import BrokerError
from .layout import KAFKA_VERSION, default_cache_dir, libs_dir

LOG4J_VERSION = "2.24.3"
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"

_POM = """<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>tokcap.local</groupId>
  <artifactId>kafka-broker-libs</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>{kafka}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>{log4j}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId>
      <version>{log4j}</version>
    </dependency>
  </dependencies>
</project>
"""

_COMPLETE_MARKER = ".complete"


def fetch(cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """Copy the broker's runtime jars into the cache once; later calls return the cached dir at once.

    A marker file is written only after Maven succeeded, so an interrupted download is redone.
    """
    cache = cache_dir or default_cache_dir()
    libs = libs_dir(cache)
    if (libs / _COMPLETE_MARKER).is_file():
        return libs
    mvn = shutil.which("mvn")
    if not mvn:
        raise BrokerError(
            "mvn not found: install Maven 3.8+ (e.g. apt-get install maven) to fetch Kafka jars"
        )
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="libs.", dir=cache))
    try:
        with tempfile.TemporaryDirectory(prefix="kafka-pom.") as project:
            (Path(project) / "pom.xml").write_text(_POM.format(kafka=KAFKA_VERSION, log4j=LOG4J_VERSION))
            cmd = [
                mvn,
                "-B",
                "-q",
                f"{DEPENDENCY_PLUGIN}:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={staging}",
            ]
            if not quiet:
                print(f"fetching Kafka {KAFKA_VERSION} jars into {libs} ...", file=sys.stderr)
            proc = subprocess.run(cmd, cwd=project, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise BrokerError(
                    f"maven failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
                )
        if not any(staging.glob(f"kafka_2.13-{KAFKA_VERSION}.jar")):
            raise BrokerError(f"maven finished but kafka_2.13-{KAFKA_VERSION}.jar is missing in {staging}")
        (staging / _COMPLETE_MARKER).write_text(f"kafka {KAFKA_VERSION} log4j {LOG4J_VERSION}\n")
        if libs.exists():
            shutil.rmtree(libs)
        staging.rename(libs)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return libs


def jar_bytes(libs: Path) -> int:
    """Total size of the cached jars, reported in docs/broker.md."""
    return sum(p.stat().st_size for p in libs.glob("*.jar"))
