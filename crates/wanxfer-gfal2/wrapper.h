/* The gfal2 plugin API as Debian's libgfal2-dev installs it; bindgen reads this file, so
 * the Rust layout of gfal_plugin_interface is the installed header's, field for field. */
#include <gfal_plugins_api.h>
