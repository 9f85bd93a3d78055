#!/bin/sh
# Prepares .criu/ at the repository's root: the CRIU that tests/gpu/restore.sh uses on a GPU
# machine, which has none and can fetch nothing, so the device tool's `carry` takes it there
# (docs/restore.md, "On a real GPU"):
#
#   .criu/bin/criu   the binary (CRIU_SRC, default ../shared/tools/criu/criu: CRIU 4.2 built on
#                    Debian 12, x86-64)
#   .criu/lib/       the shared libraries `ldd` shows it needs, but glibc's own, which the
#                    machine has (a newer one runs programs built against an older)
#   .criu/criu       runs bin/criu with LD_LIBRARY_PATH=lib, for criu alone
#
# .criu/ is in .gitignore: it travels only when `carry` names it. Run it again to replace it.
set -eu

repo=$(cd "$(dirname "$0")/../.." && pwd)
src=${CRIU_SRC:-$repo/../shared/tools/criu/criu}
[ -x "$src" ] || { echo "error: $src: no CRIU binary here (set CRIU_SRC)" >&2; exit 1; }
dest=$repo/.criu
git -C "$repo" check-ignore -q .criu/ ||
    { echo "error: $dest is not ignored by git: it would travel (and be committed) with the tree" >&2; exit 1; }

rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib"
cp "$src" "$dest/bin/criu"
ldd "$src" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | while read -r lib; do
    case ${lib##*/} in
    libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | ld-linux*) ;;
    *) cp -L "$lib" "$dest/lib/" ;;
    esac
done
cat > "$dest/criu" <<'SH'
#!/bin/sh
# CRIU with the libraries carried beside it (made by tests/gpu/carry-criu.sh).
d=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH=$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec "$d/bin/criu" "$@"
SH
chmod +x "$dest/criu"
echo "$dest: $("$dest/criu" --version | head -n 1), $(ls "$dest/lib" | wc -l) libraries, $(du -sh "$dest" | cut -f1)"
