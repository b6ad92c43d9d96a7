"""Repository shapes the closure must cover exactly, each built with the real git binary."""

from __future__ import annotations

from .conftest import Repo


def linear(r: Repo) -> None:
    r.write("README", "one\n")
    r.commit("first")
    r.write("src/a/deep.txt", "deep\n")
    r.commit("second")
    r.write("README", "two\n")
    r.commit("third")


def _branch(r: Repo) -> str:
    return r.git("symbolic-ref", "--short", "HEAD").strip()


def merges(r: Repo) -> None:
    home = _branch(r)
    r.write("base.txt", "base\n")
    r.commit("base")
    r.git("checkout", "-q", "-b", "topic")
    r.write("topic.txt", "topic\n")
    r.commit("on topic")
    r.git("checkout", "-q", home)
    r.write("main.txt", "main\n")
    r.commit("on main")
    r.git("merge", "-q", "--no-ff", "-m", "merge topic", "topic")
    r.git("checkout", "-q", "-b", "side", "HEAD~1")
    r.write("side.txt", "side\n")
    r.commit("on side")
    r.git("checkout", "-q", home)
    r.git("merge", "-q", "--no-ff", "-m", "octopus", "topic", "side")


def tags(r: Repo) -> None:
    r.write("f.txt", "tagged\n")
    first = r.commit("first")
    r.write("f.txt", "later\n")
    r.commit("second")
    r.git("tag", "light", first)
    r.git("tag", "-a", "annotated", "-m", "an annotated tag")
    r.git("tag", "-a", "outer", "-m", "a tag of a tag", "annotated")
    r.git("tag", "-a", "of-tree", "-m", "a tag of a tree", "HEAD^{tree}")
    blob = r.git("hash-object", "-w", "--stdin", input=b"only a tag reaches me\n").strip()
    r.git("tag", "-a", "of-blob", "-m", "a tag of a blob", blob)
    r.git("tag", "light-blob", r.git("hash-object", "-w", "--stdin", input=b"light\n").strip())


def symlinks_and_executables(r: Repo) -> None:
    r.write("target.txt", "target\n")
    (r.path / "link").symlink_to("target.txt")
    (r.path / "dir").mkdir(exist_ok=True)
    (r.path / "dir" / "up").symlink_to("../target.txt")
    r.write("run.sh", "#!/bin/sh\necho hi\n", mode=0o755)
    r.commit("links and executables")
    r.write("run.sh", "#!/bin/sh\necho bye\n", mode=0o755)
    r.commit("change the script")


def gitlink(r: Repo) -> None:
    r.write("file.txt", "beside a submodule\n")
    fake = ("12" * 32)[: r.algo.hex_len]  # a commit of another repository: never stored here
    r.git("update-index", "--add", "--cacheinfo", f"160000,{fake},vendor/sub")
    r.git("add", "file.txt")
    r.git("commit", "-q", "-m", "a submodule gitlink")
    r.write("more.txt", "more\n")
    r.commit("after the gitlink")


def empty_tree(r: Repo) -> None:
    home = _branch(r)
    r.commit("an empty root commit")
    r.write("x", "x\n")
    r.commit("then a file")
    r.git("checkout", "-q", "--orphan", "bare-tree")
    r.git("rm", "-q", "-rf", "--cached", ".")
    r.git("commit", "-q", "--allow-empty", "-m", "another empty tree on its own branch")
    r.git("checkout", "-q", "-f", home)


SCENARIOS = {
    "linear": linear,
    "merges": merges,
    "tags": tags,
    "symlinks-and-executables": symlinks_and_executables,
    "gitlink": gitlink,
    "empty-tree": empty_tree,
}


def everything(r: Repo) -> None:
    """Every scenario in one repository, each on its own branch."""
    r.commit("root")
    for name, build in SCENARIOS.items():
        r.git("checkout", "-q", "-b", f"s-{name}", "main")
        build(r)
    r.git("checkout", "-q", "main")


def side_branch(r: Repo, name: str, text: str) -> None:
    """A branch `name` off main with one commit of its own adding `<name>-only.txt`
    (3 objects: the commit, its tree, the blob); main is checked out again."""
    r.git("checkout", "-q", "-b", name, "main")
    r.write(f"{name}-only.txt", text)
    r.commit(name)
    r.git("checkout", "-q", "main")
