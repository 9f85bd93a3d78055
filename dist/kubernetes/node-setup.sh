#!/bin/sh
# Installs devremap on the node from this image (node-setup.yaml's init container):
#   - devremapd and devremap-runtime into the host's /usr/local/bin, each by a rename, so a
#     running daemon's SIGUSR2 upgrade finds the new binary whole;
#   - runtime.json as the host's /etc/devremap/runtime.json, only when there is none: an
#     operator's config is never overwritten;
#   - the CRI runtime handler `devremap` (containerd/devremap.toml) into the host's
#     /etc/containerd/config.toml itself, between marker lines, keeping everything else; then
#     restarts containerd in the host's namespaces, only when that file changed (and unless
#     DEVREMAP_RESTART_CONTAINERD=0).
# Not a conf.d drop-in: containerd (1.6 and 1.7) replaces a plugin's whole table with an
# imported file's, so a drop-in would drop the node's CRI settings. For the same reason, when a
# file that config.toml imports holds CRI settings, this refuses and says what to add by hand.
# A refusal installs nothing and exits 1.
#
# Paths, as the host sees them (the tests point them elsewhere): DEVREMAP_HOST (/host) is where
# the host's root is mounted ("" for this root), DEVREMAP_BIN_DIR (/usr/local/bin),
# DEVREMAP_RUNTIME_CONFIG (/etc/devremap/runtime.json), DEVREMAP_CONTAINERD_CONFIG
# (/etc/containerd/config.toml); DEVREMAP_SOURCE (/opt/devremap) is this image's files.
set -eu
host="${DEVREMAP_HOST-/host}"
src="${DEVREMAP_SOURCE:-/opt/devremap}"
bin_dir="${DEVREMAP_BIN_DIR:-/usr/local/bin}"
wrapper_config="${DEVREMAP_RUNTIME_CONFIG:-/etc/devremap/runtime.json}"
containerd_config="${DEVREMAP_CONTAINERD_CONFIG:-/etc/containerd/config.toml}"
config="$host$containerd_config"
entry="$src/containerd/devremap.toml"
cri='io.containerd.grpc.v1.cri'
begin="# >>> devremap: the CRI runtime handler devremap, added by devremap's node-setup.sh"
end="# <<< devremap"

fail() {
    echo "node-setup: $*" >&2
    exit 1
}

# The TOML in $1 without its comments (a # outside a string to the end of its line).
uncommented() {
    awk '{
        out = ""; q = ""
        for (i = 1; i <= length($0); i++) {
            c = substr($0, i, 1)
            if (q == "" && c == "#") break
            if (q == "\"" && c == "\\") { out = out c substr($0, i + 1, 1); i++; continue }
            if (q == "" && (c == "\"" || c == "\047")) q = c
            else if (q != "" && c == q) q = ""
            out = out c
        }
        print out
    }' "$1"
}

# The top level of the TOML in $1 (before its first table), without comments, on one line.
top_level() {
    uncommented "$1" | awk '/^[[:space:]]*\[/ { exit } { printf "%s ", $0 }'
}

# The files that the containerd config $1 (a path on the host) imports, one a line, as paths
# here; imports of imports too. A glob is expanded, a relative path is taken from $1's directory.
imported_files() {
    pending="$1"
    seen=""
    while [ -n "$pending" ]; do
        file="${pending%%
*}"
        case "$pending" in *"
"*) pending="${pending#*
}" ;; *) pending="" ;; esac
        case "
$seen
" in *"
$file
"*) continue ;; esac
        seen="$seen
$file"
        [ "$file" = "$1" ] || echo "$file"
        [ -f "$host$file" ] || continue
        list="$(top_level "$host$file" | sed -n 's/.*\(^\|[[:space:]]\)imports[[:space:]]*=[[:space:]]*\[\([^]]*\)\].*/\2/p')"
        for quoted in $(printf '%s\n' "$list" | grep -o "\"[^\"]*\"\|'[^']*'" || true); do
            path="$(printf '%s' "$quoted" | sed "s/^[\"']//; s/[\"']\$//")"
            case "$path" in /*) ;; *) path="${file%/*}/$path" ;; esac
            case "$path" in
            *'*'* | *'?'* | *'['*)
                for match in "$host"$path; do
                    [ -e "$match" ] && pending="$pending
${match#"$host"}"
                done
                ;;
            *) pending="$pending
$path" ;;
            esac
        done
    done
}

# $1 without the block an earlier run added.
without_block() {
    awk -v begin="$begin" -v end="$end" '$0 == begin { skip = 1 } !skip { print } $0 == end { skip = 0 }' "$1"
}

# Checks first: a refusal installs nothing.
[ -f "$src/bin/devremapd" ] && [ -f "$src/bin/devremap-runtime" ] && [ -f "$entry" ] ||
    fail "$src does not hold bin/devremapd, bin/devremap-runtime and containerd/devremap.toml"
if [ -L "$config" ] || { [ -e "$config" ] && [ ! -f "$config" ]; }; then
    fail "$config is not a regular file (a symlink?): add the tables of $entry to the file containerd reads by hand"
fi
if [ -e "$config" ]; then
    top_level "$config" | grep -Eq '(^|[[:space:]])version[[:space:]]*=[[:space:]]*2([[:space:]]|$)' ||
        fail "$config is not a version 2 config (containerd 1.6 and 1.7 write 'version = 2' at its top);" \
            "the runtime handler's tables in $entry are for version 2: add them by hand"
    rest="$(without_block "$config")"
else
    rest="version = 2"
fi

for file in $(imported_files "$containerd_config"); do
    [ -f "$host$file" ] || continue
    if uncommented "$host$file" | grep -q "$cri"; then
        fail "$config imports $file, which holds CRI settings ($cri): containerd replaces the" \
            "CRI table of config.toml with that file's, so the runtime handler added to config.toml" \
            "would be dropped. Add the tables of $entry to $file by hand (BinaryName made" \
            "$bin_dir/devremap-runtime) and restart containerd"
    fi
done

# The operator's runtime tables: the headers [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.NAME].
runtime_header="^\\[plugins\\.\"$(printf '%s' "$cri" | sed 's/\./\\./g')\"\\.containerd\\.runtimes\\.[^].]*\\]"
headers="$(printf '%s\n' "$rest" | awk '/^[[:space:]]*\[/' | tr -d ' \t' | tr "'" '"')"
body="$(printf '%s\n' "$rest" | awk '!/^[[:space:]]*\[/' | sed 's/#.*//')"
if printf '%s\n' "$body" | grep -q 'runtimes'; then
    fail "$config names runtimes outside a [plugins.\"$cri\".containerd.runtimes.NAME] table" \
        "(an inline table or a dotted key): add the tables of $entry by hand"
fi
if printf '%s\n' "$headers" | grep -q "^\\[plugins\\.\"$(printf '%s' "$cri" | sed 's/\./\\./g')\"\\.containerd\\.runtimes\\.devremap\\]"; then
    fail "$config defines the runtime devremap outside devremap's own lines: leaving it as it is"
fi

# The block: the shipped tables, naming the wrapper where this installs it. A config with no
# runtime of its own runs on the CRI plugin's default runc, which a runtimes table replaces:
# the block adds that runc back, as the defaults have it (sandbox_mode is 1.7's; 1.6 ignores it).
block="$begin"
if ! printf '%s\n' "$headers" | grep -q "$runtime_header"; then
    block="$block
[plugins.\"$cri\".containerd.runtimes.runc]
  runtime_type = \"io.containerd.runc.v2\"
  sandbox_mode = \"podsandbox\"
"
fi
# A node whose default runtime uses the systemd cgroup driver (kubeadm's nodes: the kubelet's
# driver must match) gets the handler with it too: the shim passes --systemd-cgroup to the wrapper.
default_runtime="$(printf '%s\n' "$body" | sed -n 's/^[[:space:]]*default_runtime_name[[:space:]]*=[[:space:]]*["'"'"']\([^"'"'"']*\)["'"'"'].*/\1/p' | tail -n 1)"
systemd_cgroup="$(printf '%s\n' "$rest" | sed 's/#.*//' | awk -v table="[plugins.\"$cri\".containerd.runtimes.${default_runtime:-runc}.options]" '
    /^[[:space:]]*\[/ { header = $0; gsub(/[ \t]/, "", header); gsub(/\047/, "\"", header); next }
    header == table && /^[[:space:]]*SystemdCgroup[[:space:]]*=[[:space:]]*true/ { print "yes" }')"
block="$block
$(awk '/^\[/ { on = 1 } on' "$entry" | sed "s|/usr/bin/devremap-runtime|$bin_dir/devremap-runtime|g")"
if [ -n "$systemd_cgroup" ]; then
    block="$block
    SystemdCgroup = true"
fi
block="$block
$end"
new="$rest

$block"

for bin in devremapd devremap-runtime; do
    install -D -m 0755 "$src/bin/$bin" "$host$bin_dir/.$bin.new"
    mv -f "$host$bin_dir/.$bin.new" "$host$bin_dir/$bin"
done

if [ ! -e "$host$wrapper_config" ]; then
    install -D -m 0644 "$src/runtime.json" "$host$wrapper_config"
fi

# Written by renames: a file planted at a temporary name is never followed.
changed=0
if [ ! -e "$config" ] || [ "$(cat "$config")" != "$new" ]; then
    mkdir -p "$(dirname "$config")"
    if [ -e "$config" ] && ! grep -qxF "$begin" "$config"; then
        backup="$(mktemp "$config.XXXXXX")"
        cat "$config" > "$backup"
        chmod --reference="$config" "$backup"
        mv -f "$backup" "$config.before-devremap"
        echo "node-setup: $containerd_config as it was: $containerd_config.before-devremap"
    fi
    tmp="$(mktemp "$config.XXXXXX")"
    printf '%s\n' "$new" > "$tmp"
    if [ -e "$config" ]; then chmod --reference="$config" "$tmp"; else chmod 0644 "$tmp"; fi
    mv -f "$tmp" "$config"
    changed=1
    echo "node-setup: added the runtime handler devremap to $containerd_config"
fi

if [ "$changed" = 1 ] && [ "${DEVREMAP_RESTART_CONTAINERD:-1}" = 1 ]; then
    nsenter --target 1 --mount --uts --ipc --net --pid -- systemctl restart containerd
    echo "node-setup: restarted containerd"
elif [ "$changed" = 0 ]; then
    echo "node-setup: $containerd_config already has the runtime handler devremap; containerd not restarted"
fi
echo "node-setup: devremap installed"
